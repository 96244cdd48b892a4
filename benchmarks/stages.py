"""Stage-by-stage memory, time and fidelity of the pack's configurations on one GPU.

Builds the full PixArt-Σ 1024 architecture with random weights (once, in --model-dir), then runs each
configuration in a fresh process (so no allocator state carries over) and compares its T5 embeddings
and final latents with the unquantized reference (T5 bf16, transformer fp16). Writes results.json and
results.md to --out.

    python benchmarks/stages.py --model-dir /tmp/pixart-full --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

CONFIGS = {
    # name: (T5 quantization, transformer weights, VAE tiling, pre-quantized cache)
    "reference (T5 bf16, fp16)": ("none", "none", "off", "off"),
    "recipe (T5 nf4, wo bf16, qint8)": ("nf4-recipe", "qint8", "off", "off"),
    "pack default, cache cold (T5 nf4 whole, qint8, tiling auto)": ("nf4", "qint8", "auto", "on"),
    "pack default, cache warm": ("nf4", "qint8", "auto", "on"),
    "pack, tiled decode": ("nf4", "qint8", "on", "on"),
}
SETTINGS = dict(width=1024, height=1024, steps=20, cfg=4.5, seed=0)
PROMPT = "a photo of a red cat sitting in a sunlit garden, detailed fur"


def run_one(model_dir: str, t5: str, weights: str, tiling: str, cache: str, out: Path) -> None:
    """One configuration, in this (fresh) process: the three stages, figures and tensors to ``out``."""
    import diffusers  # noqa: F401  (imported before the clock starts: ComfyUI has it loaded already)
    import transformers  # noqa: F401

    from pixart_lowvram.core import memory, models, sampler, text_encoder, vae

    source = models.resolve_model(model_dir)
    report = memory.MemoryReport()
    start = time.perf_counter()
    cache_dir = out.parent / "quant_cache" if cache == "on" else None
    embeds = text_encoder.encode(
        source, PROMPT, "", quantization=t5, device="cuda", quant_cache_dir=cache_dir, report=report
    )
    latents = sampler.sample(source, embeds, quantization=weights, device="cuda", report=report, **SETTINGS)
    images = vae.decode(source, latents, device="cuda", tiling=tiling, report=report)
    seconds = time.perf_counter() - start
    torch.save({"embeds": embeds.prompt_embeds, "latents": latents, "images": images}, out.with_suffix(".pt"))
    out.with_suffix(".json").write_text(json.dumps({**report.to_dict(), "seconds": seconds}))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--one", nargs=5, metavar=("T5", "WEIGHTS", "TILING", "CACHE", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one:
        run_one(str(args.model_dir), *args.one[:4], Path(args.one[4]))
        return 0

    from pixart_lowvram.core.random_model import ensure_random_pixart

    ensure_random_pixart(args.model_dir, "full", device="cuda", dtype=torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    shutil.rmtree(args.out / "quant_cache", ignore_errors=True)  # the first cached config starts cold
    for i, (name, (t5, weights, tiling, cache)) in enumerate(CONFIGS.items()):
        stem = args.out / f"config{i}"
        one = [t5, weights, tiling, cache, str(stem)]
        subprocess.run(
            [sys.executable, __file__, "--model-dir", str(args.model_dir), "--one", *one], check=True
        )
        settings = {"t5": t5, "weights": weights, "tiling": tiling, "quant_cache": cache}
        results[name] = {**settings, **json.loads(stem.with_suffix(".json").read_text())}
        results[name]["tensors"] = torch.load(stem.with_suffix(".pt"))
    ref = next(iter(results.values()))["tensors"]
    for r in results.values():
        tensors = r.pop("tensors")
        r["embeds_cosine"] = cosine(tensors["embeds"], ref["embeds"])
        r["latents_cosine"] = cosine(tensors["latents"], ref["latents"])
        r["image_mean_abs_diff"] = float((tensors["images"] - ref["images"]).abs().mean())
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


def markdown(meta: dict, results: dict) -> str:
    gib = 2**30
    lines = [
        f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, diffusers "
        f"{meta['diffusers']}, bitsandbytes {meta['bitsandbytes']}, optimum-quanto {meta['optimum.quanto']}; "
        "1024², 20 steps, cfg 4.5. Peaks are allocated GiB (2^30 bytes); seconds per stage and in total "
        "(weights on disk to image, in a fresh process; diffusers and transformers imported before the clock, "
        "so the total minus the stages is the rest of a cold start: bitsandbytes and optimum-quanto loading on "
        "first use, tokenizer, configs). Cosines are against the reference row of the same run; with random "
        "weights they measure the arithmetic, not image quality.",
        "",
        "| configuration | T5 peak | sampler peak | VAE peak | whole peak | T5 s | sampler s | VAE s | total s "
        "| embeds cos | latents cos |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        peaks = [stage["peak_allocated"] / gib for stage in r["stages"]]
        cells = [f"{p:.2f}" for p in [*peaks, max(peaks)]]
        cells += [f"{stage['seconds']:.2f}" for stage in r["stages"]]
        cells += [f"{r['seconds']:.2f}", f"{r['embeds_cosine']:.4f}", f"{r['latents_cosine']:.4f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
