"""Stage-by-stage memory, time and fidelity of the pack's configurations on one GPU.

Builds the full PixArt-Σ 1024 architecture with random weights (once, in --model-dir), then runs each
configuration in a fresh process (so no allocator state carries over) and compares its T5 embeddings
and final latents with the unquantized reference (T5 bf16, transformer fp16). Writes results.json and
results.md to --out. With --comfyui (a ComfyUI checkout, used in place) the table gains ComfyUI core's own
PixArt-Σ path, its memory manager told the card has --card-gb GB, with and without --lowvram
(benchmarks/comfyui_path.py).

    python benchmarks/stages.py --model-dir pixart-full --out benchmarks/results [--comfyui ComfyUI]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

# name: settings of the pack's stages; "pipeline" rows run diffusers' PixArtSigmaPipeline instead.
CONFIGS: dict[str, dict] = {
    "reference (T5 bf16, fp16)": dict(t5="none", weights="none", tiling="off", cache="off"),
    "diffusers pipeline, fp16, all on the GPU": dict(pipeline="gpu"),
    "diffusers pipeline, fp16, enable_model_cpu_offload": dict(pipeline="model_offload"),
    "recipe (T5 nf4, wo bf16, qint8)": dict(t5="nf4-recipe", weights="qint8", tiling="off", cache="off"),
    "pack default, cache cold (T5 nf4 whole, qint8, tiling auto)": dict(
        t5="nf4", weights="qint8", tiling="auto", cache="on"
    ),
    "pack default, cache warm": dict(t5="nf4", weights="qint8", tiling="auto", cache="on"),
    "pack, tiled decode": dict(t5="nf4", weights="qint8", tiling="on", cache="on"),
    "pack fast sampler path, first compile": dict(
        t5="nf4", weights="qint8", tiling="auto", cache="on", fast=True
    ),
    "pack fast sampler path, compiled code cached on disk": dict(
        t5="nf4", weights="qint8", tiling="auto", cache="on", fast=True
    ),
    "pack low-VRAM (streamed T5 nf4 + qint8, tiled decode)": dict(
        t5="nf4", weights="qint8", tiling="on", cache="on", low_vram=True
    ),
    "pack low-VRAM, T5 unquantized (bf16 streamed)": dict(
        t5="none", weights="qint8", tiling="on", cache="on", low_vram=True
    ),
}
SETTINGS = dict(width=1024, height=1024, steps=20, cfg=4.5, seed=0)
PROMPT = "a photo of a red cat sitting in a sunlit garden, detailed fur"


def run_one(model_dir: str, config: dict, out: Path) -> None:
    """One configuration, in this (fresh) process: the three stages, figures and tensors to ``out``."""
    import diffusers  # noqa: F401  (imported before the clock starts: ComfyUI has it loaded already)
    import transformers  # noqa: F401

    if "pipeline" in config:
        return run_pipeline(model_dir, config["pipeline"], out)
    from pixart_lowvram.core import measure, models, sampler, text_encoder, vae

    source = models.resolve_model(model_dir)
    report = measure.MemoryReport()
    low_vram = config.get("low_vram", False)
    start = time.perf_counter()
    cache_dir = out.parent / "quant_cache" if config["cache"] == "on" else None
    encoder = text_encoder.EncoderSettings(
        source, quantization=config["t5"], device="cuda", quant_cache=cache_dir, low_vram=low_vram
    )
    embeds = text_encoder.encode(encoder, PROMPT, "", report=report)
    transformer = sampler.SamplerSettings(
        source,
        quantization=config["weights"],
        device="cuda",
        low_vram=low_vram,
        fast=config.get("fast", False),
        **SETTINGS,
    )
    latents = sampler.sample(transformer, embeds, report=report)
    decoder = vae.DecoderSettings(source, device="cuda", tiling=config["tiling"])
    images = vae.decode(decoder, latents, report=report)
    seconds = time.perf_counter() - start
    torch.save({"embeds": embeds.prompt_embeds, "latents": latents, "images": images}, out.with_suffix(".pt"))
    out.with_suffix(".json").write_text(json.dumps({**report.to_dict(), "seconds": seconds}))


def run_pipeline(model_dir: str, placement: str, out: Path) -> None:
    """diffusers' own PixArtSigmaPipeline in fp16, all on the GPU or with model offload; one peak for the
    whole run (the pipeline has no stages to measure apart)."""
    from diffusers import PixArtSigmaPipeline

    start = time.perf_counter()
    pipe = PixArtSigmaPipeline.from_pretrained(model_dir, dtype=torch.float16)
    if placement == "gpu":
        pipe.to("cuda")
    else:
        pipe.enable_model_cpu_offload()
    generator = torch.Generator("cpu").manual_seed(SETTINGS["seed"])
    latents = pipe(
        PROMPT,
        width=SETTINGS["width"],
        height=SETTINGS["height"],
        num_inference_steps=SETTINGS["steps"],
        guidance_scale=SETTINGS["cfg"],
        generator=generator,
        output_type="latent",
        return_dict=False,
    )[0]
    images = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = {
        "stage": "whole pipeline",
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "seconds": seconds,
    }
    peak["peak_reserved"] = torch.cuda.max_memory_reserved()
    out.with_suffix(".json").write_text(json.dumps({"stages": [peak], "seconds": seconds}))
    images = (images.float().cpu().permute(0, 2, 3, 1) / 2 + 0.5).clamp(0, 1)
    torch.save(
        {"latents": (latents / pipe.vae.config.scaling_factor).float().cpu(), "images": images},
        out.with_suffix(".pt"),
    )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    parser.add_argument("--comfyui", type=Path, help="a ComfyUI checkout: add its core path's rows")
    parser.add_argument("--card-gb", type=float, default=8.0, help="the card ComfyUI's rows are told of")
    parser.add_argument(
        "--profile", action="store_true", help="write each configuration's top functions (cProfile) to OUT"
    )
    parser.add_argument("--one", nargs=2, metavar=("NAME", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        out = Path(args.one[1])
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        run_one(str(args.model_dir), CONFIGS[args.one[0]], out)
        if profile is not None:
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
            out.with_suffix(".profile.txt").write_text(text.getvalue())
        return 0

    from pixart_lowvram.cli.random_model import ensure_random_pixart

    ensure_random_pixart(args.model_dir, "full", device="cuda", dtype=torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    shutil.rmtree(args.out / "quant_cache", ignore_errors=True)  # the first cached config starts cold
    # torch.compile's on-disk cache, the same way: the first fast row compiles, the second reads it
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((args.out / "inductor_cache").resolve())
    shutil.rmtree(args.out / "inductor_cache", ignore_errors=True)
    names = args.only or list(CONFIGS)
    for i, name in enumerate(names):
        stem = args.out / f"config{i}"
        subprocess.run(
            [sys.executable, __file__, "--model-dir", str(args.model_dir), "--one", name, str(stem)]
            + (["--profile"] if args.profile else []),
            check=True,
        )
        results[name] = {**CONFIGS[name], **json.loads(stem.with_suffix(".json").read_text())}
        results[name]["tensors"] = torch.load(stem.with_suffix(".pt"), weights_only=True)
    ref = next(iter(results.values()))["tensors"]
    for r in results.values():
        tensors = r.pop("tensors")
        if "embeds" in tensors:
            r["embeds_cosine"] = cosine(tensors["embeds"], ref["embeds"])
        r["latents_cosine"] = cosine(tensors["latents"], ref["latents"])
        r["image_mean_abs_diff"] = float((tensors["images"] - ref["images"]).abs().mean())
    if args.comfyui:
        results.update(comfyui_rows(args))
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "settings": SETTINGS,
    }
    for module in ("transformers", "diffusers", "bitsandbytes", "optimum.quanto"):
        meta[module] = getattr(__import__(module, fromlist=["__version__"]), "__version__", "?")
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out / "results.md").write_text(markdown(meta, results))
    print(markdown(meta, results))
    return 0


COMFYUI_NOTE = (
    " ComfyUI rows: each stage is a loader node and the node using it (core loads lazily); embeds cos is "
    "against the pack's bf16 T5 on ComfyUI's tokens; core's noise differs, so no latents cos."
)


def comfyui_rows(args) -> dict:
    """ComfyUI core's rows, each configuration in a fresh process (benchmarks/comfyui_path.py). Their embeds
    cosine is against the pack's bf16 T5 on ComfyUI's tokens; their latents are not comparable (other noise)."""
    out = args.out / "comfyui"
    script = Path(__file__).with_name("comfyui_path.py")
    size, steps, cfg, seed = SETTINGS["width"], SETTINGS["steps"], SETTINGS["cfg"], SETTINGS["seed"]
    subprocess.run(
        [sys.executable, str(script), "--comfyui", str(args.comfyui), "--model-dir", str(args.model_dir),
         "--card-gb", str(args.card_gb), "--lowvram", "--size", str(size), "--steps", str(steps),
         "--cfg", str(cfg), "--seed", str(seed), "--out", str(out)],
        check=True,
    )  # fmt: skip
    return json.loads((out / "results.json").read_text())["results"]


def markdown(meta: dict, results: dict) -> str:
    gib = 2**30
    lines = [
        f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, diffusers "
        f"{meta['diffusers']}, bitsandbytes {meta['bitsandbytes']}, optimum-quanto {meta['optimum.quanto']}; "
        "1024², 20 steps, cfg 4.5. Peaks are allocated GiB (2^30 bytes); seconds per stage and in total "
        "(weights on disk to image, in a fresh process; diffusers and transformers imported before the clock, "
        "so the total minus the stages is the rest of a cold start: bitsandbytes and optimum-quanto loading on "
        "first use, tokenizer, configs). Cosines are against the reference row of the same run; with random "
        "weights they measure the arithmetic, not image quality."
        + (COMFYUI_NOTE if any(name.startswith("ComfyUI") for name in results) else ""),
        "",
        "| configuration | T5 peak | sampler peak | VAE peak | whole peak | T5 s | sampler s | VAE s | total s "
        "| embeds cos | latents cos |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        peaks = [stage["peak_allocated"] / gib for stage in r["stages"]]
        times = [stage["seconds"] for stage in r["stages"]]
        if len(peaks) == 1:  # a diffusers pipeline: one figure for the whole run
            cells = ["–"] * 3 + [f"{peaks[0]:.2f}"] + ["–"] * 3
        else:
            cells = [f"{p:.2f}" for p in [*peaks, max(peaks)]] + [f"{t:.2f}" for t in times]
        embeds = f"{r['embeds_cosine']:.4f}" if "embeds_cosine" in r else "–"
        latents = f"{r['latents_cosine']:.4f}" if "latents_cosine" in r else "–"
        cells += [f"{r['seconds']:.2f}", embeds, latents]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
