"""Which transformer weight formats make the PixArt-Σ sampler fast and small: each candidate in a fresh
process, on the full-size architecture (random weights) at 1024² with classifier-free guidance (batch 2),
20 transformer calls timed after warm-up. Reports the time relative to fp16 eager measured in the same
run, peak allocated memory, and the output's cosine against fp16 eager.

    python benchmarks/sampler_paths.py --model-dir pixart-full [--only NAME ...]

The candidates a run measures (fp16 eager always among them) replace those of the same name in
benchmarks/results/sampler_paths.json (and .md); the others stay, each naming its run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch

CALLS = 20  # one 20-step image with cfg: the two halves go through the transformer as one batch
TOKENS = 300
TITLE = "The sampler's weight formats against fp16"
PACKAGES = ("optimum-quanto", "torchao")

# name: (compute dtype, how the weights are made, torch.compile: False, True or a compile mode; for the
# pack's own loading ("pack-<scheme>"): "fast" = its fast path, "eager" = the same without the compile)
CANDIDATES = {
    "fp16 eager": ("float16", "none", False),
    "pack fast path: qint8, compiled blocks": ("float16", "pack-qint8", "fast"),
    "pack fast path without the compile: qint8 plain layers, eager": ("float16", "pack-qint8", "eager"),
    "pack fast path, unquantized: fp16, compiled blocks": ("float16", "pack-none", "fast"),
    "pack fast path: qfloat8, compiled blocks": ("float16", "pack-qfloat8", "fast"),
    "bf16 eager": ("bfloat16", "none", False),
    "fp16 compiled": ("float16", "none", True),
    "quanto qint8 fp16": ("float16", "quanto-qint8", False),
    "quanto qint8 fp16 compiled": ("float16", "quanto-qint8", True),
    "quanto qfloat8 fp16": ("float16", "quanto-qfloat8", False),
    "quanto qint4 fp16": ("float16", "quanto-qint4", False),
    "torchao fp8 dyn. act. + weight (row) bf16": ("bfloat16", "torchao-fp8-dynamic", False),
    "torchao fp8 dyn. act. + weight (row) bf16 compiled": ("bfloat16", "torchao-fp8-dynamic", True),
    "quanto qint8 fp16 compiled, CUDA graphs": ("float16", "quanto-qint8", "reduce-overhead"),
    "torchao fp8 weight-only bf16": ("bfloat16", "torchao-fp8-weight", False),
    "torchao int8 dyn. act. + weight fp16": ("float16", "torchao-int8-dynamic", False),
    "torchao int8 dyn. act. + weight fp16 compiled": ("float16", "torchao-int8-dynamic", True),
    "torchao int8 weight-only fp16": ("float16", "torchao-int8-weight", False),
    "torchao int8 weight-only bf16": ("bfloat16", "torchao-int8-weight", False),
}


def in_blocks(module: torch.nn.Module, name: str) -> bool:
    return isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks.")


def convert(model: torch.nn.Module, how: str) -> None:
    if how == "none":
        return
    if how.startswith("quanto-"):
        from optimum.quanto import freeze, qfloat8, qint4, qint8, quantize

        weights = {"qint8": qint8, "qfloat8": qfloat8, "qint4": qint4}[how.split("-")[1]]
        quantize(model, weights=weights, exclude=["proj_out"])
        freeze(model)
        return
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
        quantize_,
    )

    config = {
        "torchao-fp8-dynamic": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        "torchao-fp8-weight": Float8WeightOnlyConfig,
        "torchao-int8-dynamic": Int8DynamicActivationInt8WeightConfig,
        "torchao-int8-weight": Int8WeightOnlyConfig,
    }[how]()
    quantize_(model, config, filter_fn=in_blocks)


def pack_prepare(model: torch.nn.Module, scheme: str, how: str) -> torch.nn.Module:
    """The pack's own loading after from_pretrained (core/sampler.py prepare): the fast path, or its plain
    quantized layers without the compile."""
    from pixart_lowvram.core import sampler
    from pixart_lowvram.core.quant import TRANSFORMER_SCHEMES, choose

    if how == "eager":
        sampler.compile_blocks = lambda blocks: None
    cuda = torch.device("cuda")
    return sampler.prepare(model, choose(scheme, TRANSFORMER_SCHEMES, cuda), cuda, fast=True)


def run_one(model_dir: str, name: str, out: Path) -> None:
    from diffusers import PixArtTransformer2DModel

    dtype_name, how, compiled = CANDIDATES[name]
    dtype = getattr(torch, dtype_name)
    result: dict = {"name": name}
    start = time.perf_counter()
    model = PixArtTransformer2DModel.from_pretrained(model_dir, subfolder="transformer", dtype=dtype)
    if how.startswith("pack-"):
        model = pack_prepare(model, how.split("-", 1)[1], compiled)
        compiled = False  # (compiled there, block by block)
    else:
        model.to("cuda").eval()
        convert(model, how)
    torch.cuda.synchronize()
    result["prepare_s"] = time.perf_counter() - start
    result["resident_bytes"] = torch.cuda.memory_allocated()
    generator = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(2, 4, 128, 128, generator=generator).to("cuda", dtype)
    caption = torch.randn(2, TOKENS, 4096, generator=generator).to("cuda", dtype) * 0.2
    mask = torch.ones(2, TOKENS, device="cuda", dtype=torch.long)
    mask[1, 20:] = 0  # the negative: a short prompt padded, as the pipeline gives it
    timestep = torch.tensor([500, 500], device="cuda")
    if compiled:
        forward = torch.compile(model, **({"mode": compiled} if isinstance(compiled, str) else {}))
    else:
        forward = model

    def call():
        return forward(
            latents,
            encoder_hidden_states=caption,
            encoder_attention_mask=mask,
            timestep=timestep,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            return_dict=False,
        )[0]

    with torch.inference_mode():
        start = time.perf_counter()
        output = call()
        torch.cuda.synchronize()
        result["first_call_s"] = time.perf_counter() - start
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(CALLS):
            output = call()
        end.record()
        torch.cuda.synchronize()
    result["seconds"] = begin.elapsed_time(end) / 1000
    result["peak_bytes"] = torch.cuda.max_memory_allocated()
    result["finite"] = bool(torch.isfinite(output).all())
    torch.save(output.float().cpu(), out.with_suffix(".pt"))
    out.with_suffix(".json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "sampler_paths", only=True)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = harness.parse(p, argv, title=TITLE, render=markdown, required=("model_dir",))
    if args.one:
        run_one(str(args.model_dir), args.one[0], Path(args.one[1]))
        return 0
    run = harness.run(p, args, packages=PACKAGES)
    work = Path(tempfile.mkdtemp(prefix="sampler-paths-"))
    names = args.only or list(CANDIDATES)
    if "fp16 eager" not in names:
        names.insert(0, "fp16 eager")
    results = {}
    for i, name in enumerate(names):
        stem = work / f"candidate{i}"
        command = [sys.executable, __file__, "--model-dir", str(args.model_dir)]
        try:
            proc = subprocess.run(
                [*command, "--one", name, str(stem)], capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            results[name] = {"name": name, "error": f"timed out after {args.timeout} s"}
            continue
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            results[name] = {"name": name, "error": " | ".join(lines[-3:])[-600:]}
            continue
        results[name] = json.loads(stem.with_suffix(".json").read_text())
        results[name]["output"] = torch.load(stem.with_suffix(".pt"), weights_only=True)
        print(name, {k: v for k, v in results[name].items() if k != "output"}, flush=True)
    reference = results["fp16 eager"]["output"].flatten().double()
    for r in results.values():
        if "output" in r:
            out = r.pop("output").flatten().double()
            r["cosine"] = float(torch.nn.functional.cosine_similarity(out, reference, dim=0))
            r["vs_fp16"] = r["seconds"] / results["fp16 eager"]["seconds"]
    result = harness.write(args, {"rows": results}, run=run, title=TITLE, render=markdown, merge="rows")
    print(harness.markdown_text(TITLE, result, markdown))
    return 0


def markdown(result: dict) -> str:
    gib = 2**30
    cells = []
    for name, r in result["rows"].items():
        if "error" in r:
            cells.append([name, harness.run_of(result, r), f"fails: {r['error']}", "", "", "", "", ""])
            continue
        finite = "" if r["finite"] else " (not finite)"
        cells.append(
            [
                name,
                harness.run_of(result, r),
                f"{r['vs_fp16']:.3f}×",
                f"{r['seconds']:.3f}",
                f"{r['peak_bytes'] / gib:.2f}",
                f"{r['resident_bytes'] / gib:.2f}",
                f"{r['first_call_s']:.1f}",
                f"{r['cosine']:.5f}{finite}",
            ]
        )
    header = ["candidate", "run", "time vs fp16 eager", f"seconds ({CALLS} calls)", "peak GiB", "weights GiB"]
    lines = [
        f"The full-size transformer, random weights, 1024², batch 2 (cfg), {CALLS} calls timed with CUDA events "
        "after three warm-up calls, each candidate in a fresh process; time and cosine against fp16 eager of "
        "the row's own run. Peak: allocated during the calls, weights included.",
        "",
        *harness.table([*header, "first call s (compile)", "cosine vs fp16"], cells),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
