"""The command line's commands: ``demo``, ``generate``, ``cache``, and ``queue`` (a workflow on a ComfyUI
server). :mod:`.cli` is the entry point, which imports this module (torch and diffusers: seconds)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core import (
    folders,
    inputs,
    lora,
    measure,
    outputs,
    quant_cache,
    sampler,
    sampler_settings,
    text_encoder,
    timeline,
    vae,
)
from ..core.contract import check_each
from ..core.devices import PRECISIONS, as_device
from ..core.models import HUB_IDS, ModelSource, resolve_model
from ..core.pool import cache
from ..core.quant.bitsandbytes import quiet_optional_kernel_notice
from . import random_model

logger = logging.getLogger(__name__)


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default said once, and only where it tells something: argparse's "(default: …)" is
    left off where the help says the default in words, on required options, on flags, and for an empty
    default (None, "" or [])."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        said = "(default:" in (action.help or "")
        if said or action.required or action.nargs == 0 or action.default in (None, "", []):
            return action.help
        return super()._get_help_string(action)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """The options of demo and generate: the stages' inputs as they declare them, each named as the node
    input it matches (inputs.py), then the command line's own."""
    inputs.add_options(p, text_encoder.INPUTS, sampler_settings.INPUTS, vae.INPUTS)
    p.add_argument("--precision", choices=list(PRECISIONS), default="auto", help="transformer and VAE dtype")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu … (default: cuda if present, else cpu)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out"),
        help="folder for the PNG and the memory report (made if missing)",
    )
    p.add_argument("--prefix", default="pixart", help="file name prefix inside --out")
    p.add_argument("--no-snapshot", action="store_true", help="do not record the CUDA allocator history")
    p.add_argument(
        "--quant-cache",
        type=Path,
        default=None,
        help=f"folder for pre-quantized weights (default: {quant_cache.default_dir()})",
    )
    p.add_argument("--no-quant-cache", action="store_true", help="quantize on every load, save nothing")
    p.add_argument(
        "--lora",
        dest="loras",
        action="append",
        default=[],
        metavar="FILE[:STRENGTH]",
        help="a PixArt-Σ LoRA (.safetensors) added at run time to the transformer's int8 weights, at STRENGTH "
        "(default 1); repeatable, the LoRAs stack",
    )


def program_name() -> str:
    """What the command line is called, as it was started: ``pixart-lowvram`` (the installed script),
    ``python -m pixart_lowvram``, or the name of another script that calls :func:`main`."""
    started = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "python -m pixart_lowvram" if started in ("", "-c", "__main__.py") else started


def build_parser() -> argparse.ArgumentParser:
    where = (
        f"Folders: the demo's random models and the pre-quantized weights go under ${folders.HOME_ENV} "
        f"(default: pixart_lowvram in $XDG_CACHE_HOME, else in ~/.cache; here {folders.home()}); "
        f"${quant_cache.ENV} moves the pre-quantized weights alone. Images and memory reports go to --out."
    )
    parser = argparse.ArgumentParser(
        prog=program_name(),
        description="PixArt-Σ on ordinary GPUs from the command line: a demo on random weights, images from "
        "real weights, the pre-quantized weight cache, and workflows queued on a ComfyUI server.",
        epilog=where,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each stage and what it loads")
    # Not required here: main() says a missing command after any unknown option, so the option is named.
    sub = parser.add_subparsers(dest="command")
    defaults = {"formatter_class": DefaultsOnce, "epilog": where}
    demo = sub.add_parser(
        "demo",
        help="run the pipeline offline on a random-weight model built once and cached",
        description="The whole pipeline offline on a PixArt-Σ with random weights, built once: the image is "
        "noise. It shows that the stages, the memory report and the files work, not image quality.",
        **defaults,
    )
    demo.add_argument(
        "--preset",
        choices=list(random_model.PRESETS),
        default="tiny",
        help="tiny: seconds on a CPU; full: the published PixArt-Σ 1024 shapes (for a GPU)",
    )
    demo.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help=f"where the random model is cached (default: {folders.home() / 'random-PRESET'})",
    )
    _add_run_args(demo)
    cache_cmd = sub.add_parser(
        "cache",
        help="show (or clear) the pre-quantized weight cache",
        description="The pre-quantized weights: the first load of a quantized model saves them, later loads "
        "read them instead of quantizing again. Lists each entry with its size and the model it was made "
        "from; --clear deletes them all.",
        **defaults,
    )
    cache_cmd.add_argument(
        "--dir", type=Path, default=None, help=f"the cache folder (default: {quant_cache.default_dir()})"
    )
    cache_cmd.add_argument("--clear", action="store_true", help="delete every entry")
    gen = sub.add_parser("generate", help="generate with real weights", **defaults)
    gen.add_argument(
        "--model", required=True, help=f"a diffusers PixArt-Σ folder or a hub id, e.g. {HUB_IDS[0]}"
    )
    _add_run_args(gen)
    q = sub.add_parser(
        "queue", help="run an API-format workflow on a running ComfyUI and download its images", **defaults
    )
    q.add_argument("workflow", type=Path, help="an API-format workflow (e.g. workflows/api/*_api.json)")
    q.add_argument(
        "--server", default=None, help="the ComfyUI to queue on (default: this machine's, port 8188)"
    )
    q.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="NODE.INPUT=VALUE",
        help="set a node's input, typed as its current value (e.g. 2.steps=30), after --model and --size; "
        "repeatable",
    )
    q.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the model of every node that names one, as the server lists it (e.g. a folder in "
        "models/diffusers)",
    )
    q.add_argument(
        "--size",
        default=None,
        metavar="WxH",
        help="the width and height in pixels of every node that has them, e.g. 768x1344 (the sampler's "
        "resolution becomes custom)",
    )
    q.add_argument("--prompt", default=None, help="the prompt of every PixArtQ_T5Encode node")
    q.add_argument("--seed", type=int, default=None, help="every seed input")
    q.add_argument("--count", type=int, default=1, help="prompts to queue; each increments the seeds by one")
    q.add_argument("--out", type=Path, default=Path("out"), help="folder for the downloaded images")
    q.add_argument("--timeout", type=float, default=600.0, help="seconds each prompt may take")
    return parser


def queued_workflow(args: argparse.Namespace) -> dict:
    """The workflow ``queue`` sends: the file with --model, --size, --set, --prompt and --seed applied."""
    # Imported here: the HTTP and websocket libraries are needed by this command alone.
    from . import client

    size = None if args.size is None else client.parse_size(args.size)
    return client.apply_overrides(
        client.load_workflow(args.workflow),
        args.sets,
        prompt=args.prompt,
        seed=args.seed,
        model=args.model,
        size=size,
    )


def queue_workflow(args: argparse.Namespace) -> None:
    from . import client

    workflow = queued_workflow(args)
    server = args.server or client.DEFAULT_SERVER
    outcomes = client.queue(workflow, server, args.count, args.out, args.timeout)
    for outcome in outcomes:
        print(f"prompt {outcome.prompt_id}: {len(outcome.files)} image(s)")
        for path in outcome.files:
            print(f"  {path}")


def quant_cache_folder(args: argparse.Namespace) -> Path | None:
    """The pre-quantized weight cache a run uses: ``--quant-cache``, else the default folder; None with
    ``--no-quant-cache``, and None with a warning when the folder cannot be written (the cache only saves
    time: the run goes on without it)."""
    if args.no_quant_cache:
        return None
    folder = args.quant_cache or quant_cache.default_dir()
    problem = folders.unwritable(folder)
    if problem is None:
        return folder
    if args.quant_cache:
        fix = "Give --quant-cache a writable folder"
    elif os.environ.get(quant_cache.ENV):
        fix = f"Set {quant_cache.ENV} to a writable folder"
    else:
        fix = f"Set {folders.HOME_ENV} (or {quant_cache.ENV}, for this cache alone) to a writable folder"
    logger.warning(
        "the pre-quantized weight cache %s cannot be written (%s): going on without it. %s, or pass "
        "--no-quant-cache.",
        folder,
        problem.strerror or problem,
        fix,
    )
    return None


def stage_settings(args: argparse.Namespace, source: ModelSource):
    """The three stages' settings from the command line, each checked as it is made (before any model
    loads); one error names every bad input. ``args.loras`` holds the LoRAs main() checked. Low-VRAM mode
    also decodes in tiles."""
    cache_dir = quant_cache_folder(args)
    given = vars(args)
    device = as_device(args.device)
    encoding, sampling, decoding = check_each(
        lambda: text_encoder.EncoderSettings(
            source, device=device, quant_cache=cache_dir, **text_encoder.INPUTS.command_line_values(given)
        ),
        lambda: sampler_settings.SamplerSettings(
            source,
            device=device,
            precision=args.precision,
            quant_cache=cache_dir,
            loras=args.loras,
            **sampler_settings.INPUTS.command_line_values(given),
        ),
        lambda: vae.DecoderSettings(
            source,
            device=device,
            precision=args.precision,
            **{**vae.INPUTS.command_line_values(given), **({"tiling": "on"} if args.low_vram else {})},
        ),
    )
    return encoding, sampling, decoding


def weights_of(weights, component: str) -> str:
    """Where a stage's weights are read from: a single file, a model's component folder (its base folder's
    for a shared part), or a hub id's."""
    if not isinstance(weights, ModelSource):
        return str(weights.path)  # a single file
    if weights.path is None:
        return f"{component}/ of the hub model {weights.hub_id}"
    return str(weights.shared_parts().get(component, weights.path) / component)


def say_what_loads(encoding, sampling, decoding) -> None:
    """With -v: what each stage loads, from where, quantized how, in which dtype, on which device."""
    vae_weights = decoding.vae_file if decoding.vae_file is not None else weights_of(decoding.model, "vae")
    for stage, settings, weights, how in (
        ("t5_encode", encoding, weights_of(encoding.weights, "text_encoder"), encoding.scheme.name),
        ("sample", sampling, weights_of(sampling.weights, "transformer"), sampling.scheme.name),
        ("vae_decode", decoding, vae_weights, "none"),
    ):
        logger.info(
            "%s loads %s: quantization %s, %s on %s", stage, weights, how, settings.dtype, settings.device
        )
    for spec in sampling.loras:
        logger.info("sample adds the LoRA %s at strength %g", spec.path, spec.strength)


def run(args: argparse.Namespace, model: str) -> dict:
    """encode -> sample -> decode, each stage freeing its model; write PNG, report and snapshot."""
    # Every setting is checked before the first model loads (the output folder and prefix in main).
    encoding, sampling, decoding = stage_settings(args, resolve_model(model))
    say_what_loads(encoding, sampling, decoding)
    if not args.prompt.strip():
        # Allowed, as in the nodes: PixArt samples an image that follows no text, which may be a mistake.
        logger.warning("the prompt is empty: the image follows no text; give one with --prompt")
    # One image per process: nothing to keep models in host memory for (the library's pool is for a
    # process that makes many).
    cache.host_budget = 0
    device = encoding.device
    report = measure.MemoryReport()
    if not args.no_snapshot and device.type == "cuda":
        measure.history.ensure("cli")
    start = time.perf_counter()
    embeds = text_encoder.encode(encoding, args.prompt, args.negative_prompt, report=report)
    with tqdm(total=sampling.steps, desc="sampling", unit="step") as bar:
        latents = sampler.sample(
            sampling,
            embeds,
            report=report,
            on_progress=lambda step, _total, _latents: bar.update(step - bar.n),
        )
    images = vae.decode(decoding, latents, report=report)
    seconds = time.perf_counter() - start

    stem = outputs.next_stem(args.out, args.prefix)
    written = outputs.save_png(images, stem)
    # The memory report beside the images, as Memory Snapshot writes it: table, timeline, snapshot.
    written += timeline.write_report(report, stem.with_name(stem.name + "_memory")).files
    print(report.markdown())
    print(
        f"\n{len(images)} image(s) {sampling.width}x{sampling.height} in {seconds:.2f} s on {device}; wrote:"
    )
    for path in written:
        print(f"  {path}")
    if any(path.suffix == ".pickle" for path in written):
        print("open the .pickle (the allocator snapshot) at https://pytorch.org/memory_viz")
    return {"images": images, "report": report, "files": written, "seconds": seconds}


def show_cache(folder: Path, clear: bool) -> None:
    entries = quant_cache.entries(folder)
    print(f"pre-quantized weight cache: {folder} ({len(entries)} entries)")
    for entry in entries:
        print(
            f"  {entry.name}  {measure.format_bytes(quant_cache.size(entry))}  {quant_cache.describe(entry)}"
        )
    if clear:
        print(f"cleared {measure.format_bytes(quant_cache.clear(folder))}")


def check_model_folder(folder: Path, given: bool) -> None:
    """Refuse, before seconds of building, a random model folder that cannot be written."""
    problem = folders.unwritable(folder.parent)
    if problem is None:
        return
    fix = (
        "give --model-dir a writable folder"
        if given
        else f"set {folders.HOME_ENV} to a writable folder (or give one with --model-dir)"
    )
    raise ValueError(
        f"the random model cannot be written to {folder} ({problem.strerror or problem}): {fix}."
    )


def main(argv: list[str] | None = None) -> None:
    """Run the command line ``argv``; a mistake or a failure raises (:func:`.cli.main` turns it into one
    line and an exit status)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.error("the following arguments are required: command")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    # matplotlib (the memory timeline) keeps its font cache and config under the pack's home folder, not
    # in ~/.cache and ~/.config; a folder the user names for it is kept.
    os.environ.setdefault("MPLCONFIGDIR", str(folders.home() / "matplotlib"))
    quiet_optional_kernel_notice()
    measure.prefer_expandable_segments()  # before CUDA's first allocation
    if args.command == "queue":
        queue_workflow(args)
    elif args.command == "cache":
        show_cache(args.dir or quant_cache.default_dir(), args.clear)
    if args.command in ("demo", "generate"):
        # Refused before any model is built or loaded; nothing is made until an image is written.
        outputs.check_folder(args.out, "--out")
        outputs.check_prefix(args.prefix, "--prefix")
        # Each --lora's strength and file (its header: a LoRA's layers), before the demo builds its model.
        args.loras = tuple(check_each(*(partial(lora.LoraSpec.parse, text) for text in args.loras)))
    if args.command == "demo":
        folder = args.model_dir or folders.home() / f"random-{args.preset}"
        device = as_device(args.device)  # refused here, before the model is built, when it is not present
        if not (folder / "model_index.json").is_file():
            check_model_folder(folder, given=args.model_dir is not None)
            size = " (about 321 MB: its VAE is the full-size SDXL VAE)" if args.preset == "tiny" else ""
            print(
                f"building a random {args.preset} PixArt-Σ model in {folder}{size}, once …",
                file=sys.stderr,
            )
        # The full preset is built on the GPU in bf16 (fast); the tiny one in fp32 on the CPU.
        tiny = args.preset == "tiny"
        random_model.ensure_random_pixart(
            folder,
            args.preset,
            device="cpu" if tiny else device,
            dtype=torch.float32 if tiny else torch.bfloat16,
        )
        measure.free_memory()
        run(args, str(folder))
        print(
            "the weights are random, so the image is noise: this run shows that the stages, the memory "
            f"report and the files work. Real weights: {program_name()} generate --model …"
        )
    elif args.command == "generate":
        run(args, args.model)
