"""Stage-by-stage memory, time and fidelity of the pack's configurations on one GPU.

Builds the full PixArt-Σ 1024 architecture with random weights (once, in --model-dir), then runs each
configuration in a fresh process (so no allocator state carries over) and compares its T5 embeddings and
final latents with the run's first row (the unquantized reference: T5 bf16, transformer fp16, unless
``--only`` leaves it out). With --comfyui (a ComfyUI checkout, used in place) the table gains ComfyUI core's
own PixArt-Σ path, its memory manager told the card has --card-gb GB, with and without --lowvram
(comfyui_path.py). The rows a run measures replace those of the same name in benchmarks/results/stages.json
(and stages.md); the others stay, each naming its run.

    python benchmarks/stages.py --model-dir pixart-full [--comfyui ComfyUI] [--only NAME ...] [--profile]

``--profile`` writes each configuration's top functions (cProfile) to benchmarks/traces/stages/.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

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
SETTINGS = dict(width=harness.SIZE, height=harness.SIZE, steps=harness.STEPS, cfg=harness.CFG, seed=0)
PROMPT = harness.PROMPT
TITLE = "Memory and time per stage, fresh process"
PACKAGES = ("bitsandbytes", "optimum-quanto")


def run_one(model_dir: str, config: dict, out: Path) -> None:
    """One configuration, in this (fresh) process: the three stages, figures and tensors to ``out``."""
    import diffusers  # noqa: F401  (imported before the clock starts: ComfyUI has it loaded already)
    import torch
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
        compute=config.get("compute", "fp16"),
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
    import torch
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
    # The pipeline runs without autograd; its VAE's decode called here must too, or the decode's
    # activations stay referenced from the image and count in the peak.
    with torch.inference_mode():
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


def cosine(a, b) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def measure(args, work: Path) -> dict:
    """Every configuration of ``args`` in a fresh process each, its rows with cosines against the first."""
    import torch

    from pixart_lowvram.cli.random_model import ensure_random_pixart

    ensure_random_pixart(args.model_dir, "full", device="cuda", dtype=torch.bfloat16)
    # torch.compile's on-disk cache starts empty, as the quantized cache does: the first fast row
    # compiles, the second reads it.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor_cache")
    names = args.only or list(CONFIGS)
    rows, tensors = {}, {}
    for i, name in enumerate(names):
        stem = work / f"config{i}"
        command = [sys.executable, __file__, "--model-dir", str(args.model_dir), "--one", name, str(stem)]
        subprocess.run(command + (["--profile"] if args.profile else []), check=True)
        rows[name] = {**CONFIGS[name], **json.loads(stem.with_suffix(".json").read_text())}
        tensors[name] = torch.load(stem.with_suffix(".pt"), weights_only=True)
    first = names[0]
    reference = tensors[first]
    for name, row in rows.items():
        if "embeds" in tensors[name] and "embeds" in reference:
            row["embeds_cosine"] = cosine(tensors[name]["embeds"], reference["embeds"])
        row["latents_cosine"] = cosine(tensors[name]["latents"], reference["latents"])
        row["image_mean_abs_diff"] = float((tensors[name]["images"] - reference["images"]).abs().mean())
        row["cosines_against"] = first
    if args.comfyui:
        rows.update(comfyui_rows(args, work))
    return rows


def comfyui_rows(args, work: Path) -> dict:
    """ComfyUI core's rows, each configuration in a fresh process (comfyui_path.py). Their embeds cosine is
    against the pack's bf16 T5 on ComfyUI's tokens; their latents are not comparable (other noise)."""
    out = work / "comfyui"
    script = Path(__file__).with_name("comfyui_path.py")
    size, steps, cfg, seed = SETTINGS["width"], SETTINGS["steps"], SETTINGS["cfg"], SETTINGS["seed"]
    subprocess.run(
        [sys.executable, str(script), "--comfyui", str(args.comfyui), "--model-dir", str(args.model_dir),
         "--card-gb", str(args.card_gb), "--lowvram", "--size", str(size), "--steps", str(steps),
         "--cfg", str(cfg), "--seed", str(seed), "--out", str(out), "--work", str(out)],
        check=True,
    )  # fmt: skip
    rows = json.loads((out / "comfyui_path.json").read_text())["rows"]
    return {
        name: row | {"cosines_against": "the pack's bf16 T5 on ComfyUI's tokens"}
        for name, row in rows.items()
    }


COMFYUI_NOTE = (
    " ComfyUI rows: each stage is a loader node and the node using it (core loads lazily; peaks reset at "
    "each stage's start, so what an earlier stage left loaded counts); their embeds cos is against the "
    "pack's bf16 T5 on ComfyUI's tokens; core's noise differs, so no latents cos."
)


def markdown(result: dict) -> str:
    """The stages' table: per-stage peak allocated GiB, seconds, cosines, each row's run."""
    rows = result["rows"]
    lines = [
        "1024², 20 steps, cfg 4.5 unless a run's command says otherwise. Peaks are allocated GiB (2^30 "
        "bytes); seconds per stage and in total (weights on disk to image, in a fresh process; diffusers "
        "and transformers imported before the clock, so the total minus the stages is the rest of a cold "
        "start: bitsandbytes and optimum-quanto loading on first use, tokenizer, configs). Cosines are "
        "against the first row of the row's own run (the last column); with random weights they measure "
        "the arithmetic, not image quality."
        + (COMFYUI_NOTE if any(name.startswith("ComfyUI") for name in rows) else ""),
        "",
    ]
    cells = []
    for name, r in rows.items():
        peaks = [stage.get("peak_allocated") for stage in r["stages"]]
        times = [stage["seconds"] for stage in r["stages"]]
        if len(peaks) == 1:  # a diffusers pipeline: one figure for the whole run
            row = ["–"] * 3 + [harness.gib(peaks[0])] + ["–"] * 3
        elif None in peaks:  # ComfyUI's path on the CPU: no memory figures
            row = ["–"] * 4 + [f"{t:.2f}" for t in times]
        else:
            row = [harness.gib(p) for p in [*peaks, max(peaks)]] + [f"{t:.2f}" for t in times]
        row += [
            f"{r['seconds']:.2f}",
            f"{r['embeds_cosine']:.4f}" if "embeds_cosine" in r else "–",
            f"{r['latents_cosine']:.4f}" if "latents_cosine" in r else "–",
            r.get("cosines_against", "–"),
        ]
        cells.append([name, harness.run_of(result, r), *row])
    header = ["configuration", "run", "T5 peak", "sampler peak", "VAE peak", "whole peak", "T5 s"]
    header += ["sampler s", "VAE s", "total s", "embeds cos", "latents cos", "cosines against"]
    return "\n".join(lines + harness.table(header, cells)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "stages", comfyui=True, only=True)
    p.add_argument("--card-gb", type=float, default=8.0, help="the card ComfyUI's rows are told of")
    p.add_argument("--profile", action="store_true", help="each row's top functions (cProfile), in traces/")
    p.add_argument("--one", nargs=2, metavar=("NAME", "OUT"), help=argparse.SUPPRESS)
    args = harness.parse(p, argv, title=TITLE, render=markdown, required=("model_dir",))
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
            (harness.traces("stages") / f"{out.name}.profile.txt").write_text(text.getvalue())
        return 0
    run = harness.run(p, args, args.comfyui, PACKAGES)
    rows = measure(args, Path(tempfile.mkdtemp(prefix="stages-")))
    result = harness.write(args, {"rows": rows}, run=run, title=TITLE, render=markdown, merge="rows")
    print(harness.markdown_text(TITLE, result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
