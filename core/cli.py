"""Command line: ``python -m pixart_lowvram demo``, ``generate``, and ``queue`` (a workflow on a ComfyUI server)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import memory, outputs, quant_cache, random_model, sampler, text_encoder, vae
from .devices import PRECISIONS, as_device
from .models import HUB_IDS, resolve_model
from .quant import TEXT_ENCODER_SCHEMES, TRANSFORMER_SCHEMES, Quantization

logger = logging.getLogger(__name__)

DEMO_PROMPT = "a photo of a red cat in a garden"


def default_home() -> Path:
    base = (
        os.environ.get("PIXART_LOWVRAM_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pixart_lowvram"
    )
    return Path(base)


def _add_run_args(p: argparse.ArgumentParser, size: int | None) -> None:
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--negative", default="", help="negative prompt")
    p.add_argument("--width", type=int, default=size, help="pixels, a multiple of 16 (default: the model's)")
    p.add_argument("--height", type=int, default=size, help="pixels, a multiple of 16 (default: the model's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cfg", type=float, default=4.5)
    p.add_argument("--scheduler", choices=sampler.SCHEDULERS, default=sampler.DEFAULT_SCHEDULER)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--t5-quant", choices=TEXT_ENCODER_SCHEMES, default=TEXT_ENCODER_SCHEMES[0])
    p.add_argument(
        "--quant", choices=TRANSFORMER_SCHEMES, default=TRANSFORMER_SCHEMES[0], help="transformer weights"
    )
    p.add_argument("--precision", choices=list(PRECISIONS), default="auto", help="transformer and VAE dtype")
    p.add_argument(
        "--tiling",
        choices=vae.TILING,
        default="auto",
        help="VAE decode in tiles (auto: when short of memory)",
    )
    p.add_argument(
        "--low-vram",
        action="store_true",
        help="stream T5 layers and transformer blocks from CPU memory and decode in tiles (< 1 GB at 1024²)",
    )
    p.add_argument(
        "--fast",
        action="store_true",
        help="the fast sampler path: compiled blocks on weights expanded one block at a time (compiles first)",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu … (default: cuda if present)")
    p.add_argument("--out", type=Path, default=Path("out"), help="folder for the PNG and the memory report")
    p.add_argument("--prefix", default="pixart", help="file name prefix inside --out")
    p.add_argument("--no-snapshot", action="store_true", help="do not record the CUDA allocator history")
    p.add_argument(
        "--quant-cache",
        type=Path,
        default=None,
        help=f"folder for pre-quantized weights (default: ${quant_cache.ENV} or {quant_cache.default_dir()})",
    )
    p.add_argument("--no-quant-cache", action="store_true", help="quantize on every load, save nothing")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pixart_lowvram", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="run the pipeline offline on a random-weight model built once and cached"
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
        help="where the random model is cached (default: $PIXART_LOWVRAM_HOME/random-PRESET)",
    )
    _add_run_args(demo, size=None)
    cache_cmd = sub.add_parser("cache", help="show (or clear) the pre-quantized weight cache")
    cache_cmd.add_argument("--dir", type=Path, default=None, help="the cache folder (default: as for demo)")
    cache_cmd.add_argument("--clear", action="store_true", help="delete every entry")
    gen = sub.add_parser("generate", help="generate with real weights")
    gen.add_argument(
        "--model", required=True, help=f"a diffusers PixArt-Σ folder or a hub id, e.g. {HUB_IDS[0]}"
    )
    _add_run_args(gen, size=None)
    q = sub.add_parser(
        "queue", help="run an API-format workflow on a running ComfyUI and download its images"
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
        help="set a node's input, typed as its current value (e.g. 2.steps=30); repeatable",
    )
    q.add_argument("--prompt", default=None, help="the prompt of every PixArtQ_T5Encode node")
    q.add_argument("--seed", type=int, default=None, help="every seed input")
    q.add_argument("--count", type=int, default=1, help="prompts to queue; each increments the seeds by one")
    q.add_argument("--out", type=Path, default=Path("out"), help="folder for the downloaded images")
    q.add_argument("--timeout", type=float, default=600.0, help="seconds each prompt may take")
    return parser


def queue_workflow(args: argparse.Namespace) -> None:
    # Imported here: the HTTP and websocket libraries are needed by this command alone.
    from . import client

    workflow = client.apply_overrides(
        client.load_workflow(args.workflow), args.sets, prompt=args.prompt, seed=args.seed
    )
    server = args.server or client.DEFAULT_SERVER
    outcomes = client.queue(workflow, server, args.count, args.out, args.timeout)
    for outcome in outcomes:
        print(f"prompt {outcome.prompt_id}: {len(outcome.files)} image(s)")
        for path in outcome.files:
            print(f"  {path}")


def run(args: argparse.Namespace, model: str) -> dict:
    """encode -> sample -> decode, each stage freeing its model; write PNG, report and snapshot."""
    source = resolve_model(model)
    device = as_device(args.device)
    sample_size = source.config("transformer").get("sample_size", 128) * 8
    width, height = args.width or sample_size, args.height or sample_size
    # Every setting is checked before the first model loads.
    sampler.check_settings(width, height, args.steps, args.cfg, args.seed, args.batch_size, args.scheduler)
    outputs.check_prefix(args.prefix, "--prefix")
    Quantization(args.t5_quant, device, TEXT_ENCODER_SCHEMES)
    Quantization(args.quant, device, TRANSFORMER_SCHEMES)
    report = memory.MemoryReport()
    if not args.no_snapshot and device.type == "cuda":
        memory.history.ensure("cli")
    start = time.perf_counter()
    cache_dir = None if args.no_quant_cache else args.quant_cache or quant_cache.default_dir()
    embeds = text_encoder.encode(
        source,
        args.prompt,
        args.negative,
        quantization=args.t5_quant,
        device=device,
        quant_cache_dir=cache_dir,
        report=report,
        low_vram=args.low_vram,
    )
    with tqdm(total=args.steps, desc="sampling", unit="step") as bar:
        latents = sampler.sample(
            source,
            embeds,
            width=width,
            height=height,
            steps=args.steps,
            cfg=args.cfg,
            seed=args.seed,
            batch_size=args.batch_size,
            quantization=args.quant,
            scheduler=args.scheduler,
            device=device,
            dtype=args.precision,
            on_step=lambda step, total, _latents: bar.update(step - bar.n),
            report=report,
            low_vram=args.low_vram,
            fast=args.fast,
        )
    tiling = "on" if args.low_vram else args.tiling
    images = vae.decode(source, latents, device=device, dtype=args.precision, tiling=tiling, report=report)
    seconds = time.perf_counter() - start

    stem = outputs.next_stem(args.out, args.prefix)
    written = outputs.save_png(images, stem)
    # The memory report beside the images, as Memory Snapshot writes it: table, timeline, snapshot.
    written += memory.write_report(report, stem.with_name(stem.name + "_memory")).files
    print(report.markdown())
    print(f"\n{len(images)} image(s) {width}x{height} in {seconds:.2f} s on {device}; wrote:")
    for path in written:
        print(f"  {path}")
    if any(path.suffix == ".pickle" for path in written):
        print("open the .pickle (the allocator snapshot) at https://pytorch.org/memory_viz")
    return {"images": images, "report": report, "files": written, "seconds": seconds}


def show_cache(folder: Path, clear: bool) -> None:
    entries = quant_cache.entries(folder)
    print(f"pre-quantized weight cache: {folder} ({len(entries)} entries)")
    for entry in entries:
        print(f"  {entry.name}  {memory.format_bytes(quant_cache.size(entry))}")
    if clear:
        print(f"cleared {memory.format_bytes(quant_cache.clear(folder))}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    try:
        if args.command == "queue":
            queue_workflow(args)
        elif args.command == "cache":
            show_cache(args.dir or quant_cache.default_dir(), args.clear)
        elif args.command == "demo":
            folder = args.model_dir or default_home() / f"random-{args.preset}"
            device = as_device(args.device)
            if not (folder / "model_index.json").is_file():
                print(f"building a random {args.preset} PixArt-Σ model in {folder} (once) …", file=sys.stderr)
            # The full preset is built on the GPU in bf16 (fast); the tiny one in fp32 on the CPU.
            tiny = args.preset == "tiny"
            random_model.ensure_random_pixart(
                folder,
                args.preset,
                device="cpu" if tiny else device,
                dtype=torch.float32 if tiny else torch.bfloat16,
            )
            memory.free_memory()
            run(args, str(folder))
        else:
            run(args, args.model)
    except (ValueError, TypeError, FileNotFoundError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
