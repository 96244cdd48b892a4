"""ComfyUI's own PixArt-Σ path, stage by stage, with its memory manager told the card is small.

The comparison row for benchmarks/stages.py: core ComfyUI's nodes (Load CLIP type ``pixart`` + CLIP Text
Encode, Load Diffusion Model + KSampler, Load VAE + VAE Decode) called as Python from a ComfyUI checkout
used as a library (``--comfyui``; nothing of it is copied). The diffusers folder's weights are written once
as the single files core loads (T5 as ``t5xxl``-layout fp16, the transformer in the original PixArt layout,
the VAE file) into a temporary models tree, then each configuration runs in a fresh process:

- card told N GB (``--card-gb``, 0 = the card as it is): before ``comfy.model_management`` is imported,
  ``torch.cuda.mem_get_info`` reports total = N GiB and free = N GiB − this process's reserved memory, and
  ``torch.cuda.set_per_process_memory_fraction`` caps the allocator at N GiB (``--reserve-vram`` alone
  does not do it: core places T5 by the real free memory). The CUDA context is not counted, so a real
  N GB card has a few hundred MB less.
- ``--lowvram`` adds each card size again with ComfyUI's ``--lowvram`` (``args.lowvram`` set before
  ``model_management`` is imported, as main.py's parsing does).

ComfyUI loads models lazily, inside the encode, sampling and decode calls, so each stage times the loader
node together with the node that uses it (loader seconds are recorded apart too); peaks are reset at each
stage's start and include what earlier stages left loaded, as in a server. The models stay referenced to
the end, as the server's node cache keeps them. Sampler: ``dpmpp_2m`` with the ``normal`` schedule, the
closest to PixArt's own DPM-Solver++ (2nd order, linspace timesteps).

Fidelity: the only comparable figure is the T5 conditioning: the cosine of core's prompt embeddings
against the pack's bf16 T5 on the same tokens (ComfyUI's T5 tokenizer, embeddings unpadded as
core.conditioning makes them). ComfyUI's noise differs from diffusers' for the same seed, so its latents
and images are saved but not compared with the pack's.

stages.py runs it with ``--comfyui`` and takes its rows into its own table (benchmarks/results/stages.json).
On its own, on one GPU (writes comfyui_path.json and comfyui_path.md to --out, the tensors to --work):

    python benchmarks/comfyui_path.py --comfyui /path/to/ComfyUI --model-dir pixart-full \\
        --card-gb 8 --lowvram --out DIR

A functional check without CUDA (ComfyUI's --cpu mode, T5 in bf16 there; no memory figures): ``--device
cpu --size 512 --steps 2`` (core's position embedding fails below about 320 px).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

PROMPT = harness.PROMPT  # stages.py's
TITLE = "ComfyUI core's own PixArt-Σ path, stage by stage"
FILES = {  # ComfyUI models folder: file name
    "text_encoders": "t5xxl_fp16.safetensors",
    "diffusion_models": "pixart_sigma.safetensors",
    "vae": "pixart_sigma_vae.safetensors",
}
GIB = 2**30
# Log lines of core's memory manager worth keeping: how each model was placed, the decode fallback.
NOTABLE = ("loaded partially", "loaded completely", "Unloaded partially", "Ran out of memory", "vram state")


def config_name(card_gb: float, lowvram: bool) -> str:
    card = f"card told {card_gb:g} GB" if card_gb else "card as it is"
    return f"ComfyUI core path, {card}" + (", --lowvram" if lowvram else "")


def write_models_tree(model_dir: Path, tree: Path) -> None:
    """The diffusers folder's weights as the single files core's loaders read (once; reused if present)."""
    import torch

    from pixart_lowvram.cli.random_model import save_single_file_t5, save_single_file_transformer

    paths = {folder: tree / folder / name for folder, name in FILES.items()}
    if not paths["text_encoders"].is_file():
        save_single_file_t5(model_dir, paths["text_encoders"], dtype=torch.float16)
    if not paths["diffusion_models"].is_file():
        save_single_file_transformer(model_dir, paths["diffusion_models"])
    if not paths["vae"].is_file():  # diffusers' key layout: core's VAE converts it on load
        paths["vae"].parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_dir / "vae" / "diffusion_pytorch_model.safetensors", paths["vae"])


def simulate_card(card_gb: float) -> dict:
    """Make this process's CUDA look like a card of ``card_gb`` GiB to ComfyUI's memory manager; before
    comfy.model_management is imported (it reads the total once, at import)."""
    import torch

    real_free, real_total = torch.cuda.mem_get_info()
    card = int(card_gb * GIB)
    if card > real_total:
        raise ValueError(f"--card-gb {card_gb:g} is more than this GPU's {real_total / GIB:.1f} GiB.")
    torch.cuda.set_per_process_memory_fraction(card / real_total)

    def mem_get_info(device=None):
        return max(card - torch.cuda.memory_reserved(device), 0), card

    torch.cuda.mem_get_info = mem_get_info
    return {"real_total": real_total, "real_free": real_free, "card": card}


def run_one(comfyui: Path, tree: Path, config: dict, settings: dict, out: Path) -> None:
    """One configuration, in this (fresh) process: core's nodes stage by stage, figures and tensors to out."""
    sys.path.insert(0, str(comfyui))
    from comfy.cli_args import args  # parsed from no arguments: ComfyUI's defaults

    cpu = config["device"] == "cpu"
    args.cpu = cpu
    args.bf16_text_enc = cpu  # the CPU check only: core's default fp16 T5 is very slow on a CPU
    args.lowvram = config["lowvram"]
    import cuda_malloc  # noqa: F401  (main.py's allocator choice, made before torch is imported)
    import torch

    simulated = simulate_card(config["card_gb"]) if not cpu and config["card_gb"] else None
    log: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if any(text.lower() in message.lower() for text in NOTABLE):
                log.append(message)

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger().addHandler(Keep())
    import comfy.model_management as mm
    import folder_paths

    import nodes

    for folder in FILES:
        folder_paths.add_model_folder_path(folder, str(tree / folder), is_default=True)
    cuda = torch.cuda.is_available() and not cpu
    stages: list[dict] = []
    keep: dict = {}  # what a server's node cache would hold: loaded models stay referenced to the end

    def stage(name: str, loader, use) -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        record = {"stage": name, "device": str(mm.get_torch_device())}
        if cuda:
            record.update(
                start_allocated=torch.cuda.memory_allocated(), start_reserved=torch.cuda.memory_reserved()
            )
        start = time.perf_counter()
        loaded = loader()
        record["loader_seconds"] = time.perf_counter() - start
        keep[name] = loaded, use(loaded)
        if cuda:
            torch.cuda.synchronize()
        record["seconds"] = time.perf_counter() - start
        if cuda:
            record.update(
                peak_allocated=torch.cuda.max_memory_allocated(),
                peak_reserved=torch.cuda.max_memory_reserved(),
            )
        stages.append(record)

    def encode(clip):
        text_encode = nodes.CLIPTextEncode()
        return text_encode.encode(clip, PROMPT)[0], text_encode.encode(clip, "")[0]

    def sample(model):
        size = settings["size"]
        latent = nodes.EmptyLatentImage().generate(size, size, 1)[0]
        positive, negative = keep["T5"][1]
        return nodes.KSampler().sample(
            model, settings["seed"], settings["steps"], settings["cfg"], settings["sampler"],
            settings["scheduler"], positive, negative, latent,
        )[0]  # fmt: skip

    start = time.perf_counter()
    stage("T5", lambda: nodes.CLIPLoader().load_clip(FILES["text_encoders"], "pixart")[0], encode)
    stage("sampler", lambda: nodes.UNETLoader().load_unet(FILES["diffusion_models"], "default")[0], sample)
    stage(
        "VAE",
        lambda: nodes.VAELoader().load_vae(FILES["vae"])[0],
        lambda vae: nodes.VAEDecode().decode(vae, keep["sampler"][1])[0],
    )
    seconds = time.perf_counter() - start
    (positive, negative), latents, images = keep["T5"][1], keep["sampler"][1]["samples"], keep["VAE"][1]
    torch.save(
        {
            "embeds": positive[0][0].float().cpu(),
            "negative_embeds": negative[0][0].float().cpu(),
            "latents": latents.float().cpu(),
            "images": images.float().cpu(),
        },
        out.with_suffix(".pt"),
    )
    peaks = [s["peak_allocated"] for s in stages if "peak_allocated" in s]
    result = {
        "stages": stages,
        "seconds": seconds,
        "peak_allocated": max(peaks) if peaks else None,
        "peak_reserved": max((s["peak_reserved"] for s in stages if "peak_reserved" in s), default=None),
        "vram_state": mm.vram_state.name,
        "total_vram_seen": mm.total_vram * 2**20,
        "simulated": simulated,
        "comfyui_log": log,
        "allocator": torch.cuda.get_allocator_backend() if cuda else None,
        "dtypes": {
            "text_encoder": str(next(keep["T5"][0].cond_stage_model.parameters()).dtype),
            "transformer": str(keep["sampler"][0].model_dtype()),
            "vae": str(keep["VAE"][0].vae_dtype),
        },
    }
    out.with_suffix(".json").write_text(json.dumps(result))


def reference_embeds(model_dir: Path, comfyui: Path, device: str, out: Path) -> None:
    """The pack's T5 in bf16 on ComfyUI's T5 tokenizer, unpadded as core.conditioning makes it (in a
    fresh process: nothing of it stays on the GPU). The model folder is shown without its tokenizer, alone
    in a folder of its own, so that the fallback tokenizer is the one used."""
    import torch

    from pixart_lowvram.core import text_encoder
    from pixart_lowvram.core.conditioning import core_conditioning
    from pixart_lowvram.core.models import MODEL_INDEX, resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "alone" / "pixart-without-tokenizer"
        folder.mkdir(parents=True)
        for name in (MODEL_INDEX, "text_encoder"):
            (folder / name).symlink_to((model_dir / name).resolve())
        settings = text_encoder.EncoderSettings(
            resolve_model(str(folder)),
            quantization="none",
            device=device,
            precision=torch.bfloat16,
            tokenizer_fallback=comfyui / "comfy" / "text_encoders" / "t5_tokenizer",
        )
        embeds = text_encoder.encode(settings, PROMPT, "")
    positive, negative = core_conditioning(embeds)
    torch.save({"embeds": positive[0][0], "negative_embeds": negative[0][0]}, out)


def cosine(a, b) -> float | None:
    import torch

    if a.shape != b.shape:  # different token counts: not comparable
        return None
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "comfyui_path", comfyui=True, size=harness.SIZE, steps=harness.STEPS)
    p.add_argument("--card-gb", type=float, nargs="+", default=[8.0], help="card sizes to tell (0: as is)")
    p.add_argument("--lowvram", action="store_true", help="also run each card size with --lowvram")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a functional check")
    p.add_argument("--cfg", type=float, default=harness.CFG)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler", default="dpmpp_2m")
    p.add_argument("--scheduler", default="normal")
    p.add_argument("--models-tree", type=Path, help="keep the single files here (default: a temporary one)")
    p.add_argument("--work", type=Path, help="the folder for the tensors (default: a new temporary one)")
    p.add_argument("--one", nargs=3, metavar=("TREE", "CONFIG", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--reference", metavar="OUT", help=argparse.SUPPRESS)
    args = harness.parse(p, argv, title=TITLE, render=markdown, required=("comfyui", "model_dir"))
    settings = {key: getattr(args, key) for key in ("size", "steps", "cfg", "seed", "sampler", "scheduler")}
    if args.one:
        run_one(
            args.comfyui.resolve(), Path(args.one[0]), json.loads(args.one[1]), settings, Path(args.one[2])
        )
        return 0
    if args.reference:
        reference_embeds(args.model_dir, args.comfyui.resolve(), args.device, Path(args.reference))
        return 0

    if not (args.comfyui / "comfy" / "model_management.py").is_file():
        p.error(f"--comfyui {args.comfyui} is not a ComfyUI checkout (no comfy/model_management.py).")
    work = (args.work or Path(tempfile.mkdtemp(prefix="comfyui-path-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = args.models_tree or Path(tempfile.mkdtemp(prefix="comfyui-models-"))
    common = [sys.executable, __file__, "--comfyui", str(args.comfyui), "--model-dir", str(args.model_dir)]
    common += [f"--{key}={value}" for key, value in settings.items()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = harness.run(p, args, args.comfyui)
    results = {}
    try:
        start = time.perf_counter()
        write_models_tree(args.model_dir, tree)
        print(f"models tree written in {time.perf_counter() - start:.1f} s: {tree}", flush=True)
        reference = work / "reference.pt"
        subprocess.run([*common, "--device", args.device, "--reference", str(reference)], check=True, env=env)
        configs = [
            {"card_gb": card, "lowvram": lowvram, "device": args.device}
            for card in args.card_gb
            for lowvram in ([False, True] if args.lowvram else [False])
        ]
        for i, config in enumerate(configs):
            name, stem = config_name(config["card_gb"], config["lowvram"]), work / f"comfyui{i}"
            print(f"running: {name}", flush=True)
            subprocess.run([*common, "--one", str(tree), json.dumps(config), str(stem)], check=True, env=env)
            results[name] = {**config, **json.loads(stem.with_suffix(".json").read_text())}
            results[name]["tensors"] = str(stem.with_suffix(".pt"))
    finally:
        if args.models_tree is None:
            shutil.rmtree(tree, ignore_errors=True)
    fidelity(results, reference)
    result = harness.write(args, {"rows": results}, run=run, title=TITLE, render=markdown)
    print(harness.markdown_text(TITLE, result, markdown))
    return 0


def fidelity(results: dict, reference: Path) -> None:
    import torch

    ref = torch.load(reference, weights_only=True)
    for r in results.values():
        tensors = torch.load(r.pop("tensors"), weights_only=True)
        for key in ("embeds", "negative_embeds"):  # absent where the token counts differ
            if (value := cosine(tensors[key], ref[key])) is not None:
                r[f"{key}_cosine"] = value
        r["tokens"] = {"core": tensors["embeds"].shape[1], "pack": ref["embeds"].shape[1]}


def markdown(result: dict) -> str:
    """stages.py's table: per-stage peak allocated GiB, seconds, cosines."""
    import stages

    return stages.markdown(result)


if __name__ == "__main__":
    sys.exit(main())
