"""Where the pack's remaining extra over fp16 goes, one question each, on the GPU:

- ``t5``: a later prompt's T5 stage with the defaults (T5 nf4 back from the host-memory pool, one new text,
  the empty negative prompt remembered): the stage as it runs (the copy back under the encode), then the
  copy and the encode each alone and synchronised, then where the CPU time goes (cProfile) and the GPU's
  (torch's profiler);
- ``cache``: later prompts (the library's three stages, as ``warm.py``'s ``pack defaults`` runs them) with the
  CUDA cache emptied at every stage's end, as the library does, or kept, under PyTorch's expandable segments
  (what the command line asks for) and under ``cudaMallocAsync`` (what ComfyUI picks on NVIDIA), each in a
  process of its own. Through a server ComfyUI empties the cache itself whenever it unloads a model
  (``model_management.free_memory`` → ``soft_empty_cache``), so every stage there pays what ``empty`` pays;
- ``vae``: the decode at 1024² in bf16 (the SDXL VAE, random weights) with cuDNN's autotuning off and on,
  and with its convolutions whole instead of in strips;
- ``copy``: the host→GPU rate from page-locked memory (T5's 2.3 GiB at once).

    python -m pixart_lowvram demo --preset full --model-dir pixart-full --device cuda --steps 2
    python benchmarks/probes.py --model-dir pixart-full t5 cache vae copy

Prints what it measured; the runs of 2026-12-02: benchmarks/results/probes.md, discussed in docs/BENCHMARKS.md
("What stands in the way, measured").
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ALLOCATORS = {"expandable segments": "expandable_segments:True", "cudaMallocAsync": "backend:cudaMallocAsync"}
TEXTS = [f"photo {i}: a red fox in fresh snow at dawn, soft light, detailed fur" for i in range(12)]


def median_ms(fn, reps: int = 6) -> float:
    """The median of ``reps`` synchronised calls of ``fn`` after two warm-up calls, in milliseconds."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def probe_t5(model_dir: Path, quant_cache: Path) -> None:
    from pixart_lowvram.core import models, streaming
    from pixart_lowvram.core import text_encoder as t5

    settings = t5.EncoderSettings(
        models.resolve_model(str(model_dir)), device="cuda", quant_cache=quant_cache
    )

    def stage(index: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        t5.encode(settings, TEXTS[index], "")
        return time.perf_counter() - start

    print(f"t5: first prompt {stage(0):.3f} s; later stages {[round(stage(i), 3) for i in range(1, 5)]} s")
    parts: dict[str, list[float]] = {"copy back": [], "encode": []}

    def synchronised(name: str, fn):
        def run(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            torch.cuda.synchronize()
            parts[name].append(time.perf_counter() - start)
            return result

        return run

    to, encode_text = streaming.HostCopy.to, t5._encode_text
    streaming.HostCopy.to = synchronised("copy back", to)
    t5._encode_text = synchronised("encode", encode_text)
    try:
        serial = [round(stage(i), 3) for i in range(5, 8)]
    finally:
        streaming.HostCopy.to, t5._encode_text = to, encode_text
    shown = {name: [round(s, 3) for s in seconds] for name, seconds in parts.items()}
    print(f"t5: each part alone (synchronised): stages {serial} s, {shown}")
    profiler = cProfile.Profile()
    profiler.enable()
    stage(8)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue())
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stage(9)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


def probe_cache(model_dir: Path, quant_cache: Path) -> None:
    for allocator, setting in ALLOCATORS.items():
        for mode in ("empty", "keep"):
            env = os.environ | {"PYTORCH_CUDA_ALLOC_CONF": setting}
            command = [
                sys.executable,
                __file__,
                "--model-dir",
                str(model_dir),
                "--quant-cache",
                str(quant_cache),
            ]
            proc = subprocess.run(
                [*command, f"cache-{mode}"], env=env, capture_output=True, text=True, check=False
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            print(f"cache, {allocator}, {mode}: {lines[-1] if lines else proc.stderr[-2000:]}")


def cache_run(model_dir: Path, quant_cache: Path, keep: bool) -> None:
    """Six prompts as warm.py's ``pack defaults`` runs them; ``keep``: no stage empties the CUDA cache."""
    sys.path.insert(0, str(Path(__file__).parent))
    import warm

    from pixart_lowvram.core import measure

    if keep:

        def free_memory(collect: bool = True) -> None:  # the library's, without handing the cache back
            if collect:
                measure._model_let_go = False
                gc.collect()

        measure.free_memory = free_memory
    records, _images = warm.run_pack(model_dir, {}, quant_cache)
    later = records[1:5]
    print(
        json.dumps(
            {
                "prompts s": [round(r["seconds"], 3) for r in records],
                "later s": round(statistics.mean(r["seconds"] for r in later), 3),
                "stages s": {name: [r["stages"][name] for r in later] for name in later[0]["stages"]},
                "peak allocated GiB": round(max(r["peak_allocated"] for r in later) / 2**30, 2),
                "peak reserved GiB": round(max(r["peak_reserved"] for r in later) / 2**30, 2),
                "reserved after GiB": round(torch.cuda.memory_reserved() / 2**30, 2),
            }
        )
    )


def probe_vae() -> None:
    from diffusers import AutoencoderKL

    from pixart_lowvram.core import vae

    torch.manual_seed(0)
    model = AutoencoderKL.from_config(vae.SDXL_VAE_CONFIG).to(torch.bfloat16)
    vae.decode_in_place(model)
    vae.decode_in_strips(model)
    model.to("cuda").eval()
    latents = torch.randn(1, 4, 128, 128, device="cuda", dtype=torch.bfloat16)
    images = {}
    with torch.inference_mode():
        for autotune in (False, True):
            torch.backends.cudnn.benchmark = autotune
            ms = median_ms(lambda: model.decode(latents, return_dict=False))
            images[autotune] = model.decode(latents, return_dict=False)[0].float().cpu()
            print(f"vae: decode 1024² bf16, convolutions in strips, cudnn.benchmark {autotune}: {ms:.1f} ms")
        torch.backends.cudnn.benchmark = False
        print(
            f"vae: autotuned image - plain image, largest difference {(images[True] - images[False]).abs().max():g}"
        )
        for module in model.decoder.modules():
            if type(module) is vae.StripConv2d:
                module.__class__ = torch.nn.Conv2d
        ms = median_ms(lambda: model.decode(latents, return_dict=False))
        print(f"vae: decode 1024² bf16, convolutions whole: {ms:.1f} ms")


def probe_copy() -> None:
    size = int(2.3 * 2**30)
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    device = torch.empty_like(host, device="cuda")
    ms = median_ms(lambda: device.copy_(host, non_blocking=True), reps=5)
    print(f"copy: 2.3 GiB page-locked host -> GPU: {ms:.1f} ms, {size / ms / 1e6:.1f} GB/s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--quant-cache", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument(
        "probes", nargs="+", choices=["t5", "cache", "vae", "copy", "cache-empty", "cache-keep"]
    )
    args = parser.parse_args()
    model_dir = args.model_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="probes-") as folder:
        quant_cache = args.quant_cache or Path(folder)
        for probe in args.probes:
            if probe == "t5":
                probe_t5(model_dir, quant_cache)
            elif probe == "cache":
                probe_cache(model_dir, quant_cache)
            elif probe.startswith("cache-"):
                cache_run(model_dir, quant_cache, keep=probe == "cache-keep")
            elif probe == "vae":
                probe_vae()
            else:
                probe_copy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
