"""The sampler's ``compute`` paths against fp16, on the GPU: the block's matrix products, the sampler stage
alone, each path's fidelity prompt by prompt, and where each path's GPU time goes.

    python benchmarks/compute.py --model-dir pixart-full

(the full-size random model: ``python -m pixart_lowvram demo --preset full --model-dir pixart-full --device
cuda --steps 2``). Writes compute.json and compute.md to --out (benchmarks/results), again after each row so
that a run cut short keeps what it measured. Three parts, in one process (``--part`` names some of them):

- ``kernels``: each linear layer of a PixArt-Σ block at 1024² with guidance (M = 8192 rows: two images of
  4096 tokens; the cross-attention's k and v take the caption's 2 × 300), median of 50 after warm-up:
  fp16 ``F.linear``; the pack's int8 and fp8 layers eager (the activation's quantization as separate ops);
  then attn1's q/k/v, ff1 and ff2 compiled (inductor) together with the op before each as it runs in the
  block (LayerNorm and the adaLN modulation before q, k, v and ff1; tanh-GELU before ff2; nothing before the
  attention's output projection), the fp16 layer compiled the same way beside it; and comfy-kitchen's
  ``int8_linear`` (tensor-wise weight scale, per-token activations) where it is installed. Then each fused
  quantization kernel (core/quant/fused_kernels.py) at its shape, GPU time in CUDA graphs, beside the same
  op eager and a copy of its input.
- ``sampler``: the sampler stage alone, 1024², 20 steps, cfg 4.5, dpmsolver++ (the settings below), the
  transformer kept loaded so that only the steps and the stage's own work count; median of the later runs
  after the first (which loads and compiles). Rows: diffusers' fp16 transformer in its own pipeline (the
  fp16 model: the anchor's 20 steps), and the pack's sampler with compute fp16, fp16 + fast, int8 and fp8
  each with ``PIXART_LOWVRAM_FUSED_QUANT=1`` (``"fused": true``: the fused quantization kernels, the default
  on CUDA with Triton) and ``=0`` (``"fused": false``: each layer quantizes its input, inductor fusing what
  it can); fp8 fused once more with ``PIXART_LOWVRAM_CUDA_GRAPH=1`` (``"graph": true``: each step after the
  first replayed from the run's CUDA graph, core/step_graph.py, not launched kernel by kernel). With each
  its GPU peak allocated during a run (the kept weights included). Then the fidelity: five prompts (the
  harness's, each with its seed) encoded once by the pack's T5 stage; each 8-bit path's latents against
  compute fp16's, prompt by prompt (cosine), and the decoded images' PSNR (8-bit pixels).
  Random weights are not trained weights: these say how far the 8-bit arithmetic moves this network, not
  how a trained model's pictures change.
- ``profile``: CUDA kernel time by kind per transformer forward, and the GPU's busy time against the wall
  clock, of compiled fp16 + fast, fp8 (fast and exact accumulation) and int8 with each layer quantizing its
  input, and fp8 with the fused quantization.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

GIB = harness.GIB
TITLE = "compute: the 8-bit paths against fp16"
SETTINGS = {
    "width": harness.SIZE,
    "height": harness.SIZE,
    "steps": harness.STEPS,
    "cfg": harness.CFG,
    "scheduler": "dpmsolver++",
}
COMPUTE_ROWS = {
    "pack compute fp16": {"compute": "fp16"},
    "pack compute fp16 + fast": {"compute": "fp16", "fast": True},
    "pack compute int8, fused quantization": {"compute": "int8", "fused": True},
    "pack compute fp8, fused quantization": {"compute": "fp8", "fused": True},
    "pack compute fp8, fused quantization, a CUDA graph a step": {
        "compute": "fp8",
        "fused": True,
        "graph": True,
    },
    "pack compute int8, quantization unfused": {"compute": "int8", "fused": False},
    "pack compute fp8, quantization unfused": {"compute": "fp8", "fused": False},
}
# The fused quantization kernels at PixArt-Σ XL's 1024² shapes with guidance: (op, input shape).
FUSED_SHAPES = [
    ("norm_modulate_quantize", (2, 4096, 1152)),
    ("quantize_rows", (8192, 1152)),
    ("gelu_quantize", (8192, 4608)),
]
FIDELITY_REFERENCE = "pack compute fp16"
# Row options that are the pack's environment switches, not sampler settings (see isolated).
SWITCHES = ("fused", "graph")
# PixArt-Σ XL's block at 1024² with guidance: (name, in, out, rows, the op before it).
HIDDEN, FF, TOKENS, CAPTION = 1152, 4608, 2 * 4096, 2 * 300
SHAPES = [
    ("attn1 q/k/v", HIDDEN, HIDDEN, TOKENS, "norm"),
    ("attn1 out", HIDDEN, HIDDEN, TOKENS, None),
    ("attn2 q", HIDDEN, HIDDEN, TOKENS, "norm"),
    ("attn2 k/v (caption)", HIDDEN, HIDDEN, CAPTION, None),
    ("ff1", HIDDEN, FF, TOKENS, "norm"),
    ("ff2", FF, HIDDEN, TOKENS, "gelu"),
]
# The layers also measured compiled with the op before them (one of each kind: a compile costs seconds).
COMPILED = ("attn1 q/k/v", "ff1", "ff2")
RUNS = 4  # sampler runs per row: the first loads and compiles, the others are measured
# The profiled rows: the sampler's options and fp8's fast accumulation (Hopper's; off: exact).
PROFILE_ROWS = {
    "fp16 + fast": ({"compute": "fp16", "fast": True}, True),
    "fp8, quantization unfused": ({"compute": "fp8", "fused": False}, True),
    "fp8, exact accumulation, quantization unfused": ({"compute": "fp8", "fused": False}, False),
    "int8, quantization unfused": ({"compute": "int8", "fused": False}, True),
    "fp8, fused quantization": ({"compute": "fp8", "fused": True}, True),
}
PARTS = ("kernels", "sampler", "profile")


def median_ms(fn, repeat: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Before(torch.nn.Module):
    """A layer with the op before it in the block: what inductor fuses the activation's quantization into."""

    def __init__(self, layer: torch.nn.Module, op: str | None, width: int):
        super().__init__()
        self.layer, self.op = layer, op
        self.shift = torch.nn.Parameter(torch.randn(width, device="cuda", dtype=torch.float16) * 0.1)
        self.scale = torch.nn.Parameter(torch.randn(width, device="cuda", dtype=torch.float16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op == "norm":
            x = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + self.scale) + self.shift
        elif self.op == "gelu":
            x = F.gelu(x, approximate="tanh")
        return self.layer(x)


def kernels() -> list[dict]:
    from pixart_lowvram.core.quant import quanto

    try:
        import comfy_kitchen
    except ImportError:
        comfy_kitchen = None
    rows = []
    torch.manual_seed(0)
    for name, width, out, m, op in SHAPES:
        weight = torch.randn(out, width, device="cuda") * 0.02
        scale = weight.abs().amax(1, keepdim=True) / 127
        data = (weight / scale).round().clamp(-127, 127).to(torch.int8)
        x = torch.randn(m, width, device="cuda", dtype=torch.float16)
        bias = torch.randn(out, device="cuda", dtype=torch.float16) * 0.1
        dense = (data.half() * scale.half()).contiguous()
        row = {"layer": name, "in": width, "out": out, "rows": m, "before": op or "-"}
        row["fp16 F.linear"] = median_ms(lambda x=x, dense=dense, bias=bias: F.linear(x, dense, bias))
        layers = {}
        for compute in ("fp16", "int8", "fp8"):
            layer = quanto.ScaledWeightLinear(data.clone(), scale.half(), bias)
            quanto.set_compute(layer, compute)
            if compute == "fp16":
                layer.weight_dense = dense
            layers[compute] = layer
            if compute != "fp16":
                row[f"{compute} eager"] = median_ms(lambda x=x, layer=layer: layer(x))
                reference = F.linear(x.float(), dense.float(), bias.float())
                got = layer(x).float()
                row[f"{compute} rel. error"] = float((got - reference).norm() / reference.norm())
        for compute, layer in layers.items():
            if name not in COMPILED:
                continue
            torch._dynamo.reset()  # each its own graphs, not a recompile of the last module's (limit 8)
            fused = torch.compile(Before(layer, op, width), backend="inductor", dynamic=False)
            with torch.no_grad():
                row[f"{compute} compiled with the op before"] = median_ms(lambda x=x, fused=fused: fused(x))
        if comfy_kitchen is not None:
            tensor_scale = weight.abs().amax() / 127
            tensorwise = (weight / tensor_scale).round().clamp(-127, 127).to(torch.int8)
            try:
                row["comfy-kitchen int8_linear"] = median_ms(
                    functools.partial(
                        comfy_kitchen.int8_linear,
                        x,
                        tensorwise,
                        tensor_scale.float(),
                        bias,
                        out_dtype=torch.float16,
                        input_act="gelu_tanh" if op == "gelu" else None,
                    )
                )
            except Exception as exc:  # a kitchen without CUDA kernels for this card
                row["comfy-kitchen int8_linear"] = f"{type(exc).__name__}: {exc}"[:120]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def encode_prompts(source, quant_cache: Path):
    from pixart_lowvram.core import text_encoder

    settings = text_encoder.EncoderSettings(source, device="cuda", quant_cache=quant_cache)
    return [(text_encoder.encode(settings, text, ""), seed) for text, seed in harness.PROMPTS]


def timed(fn) -> tuple[float, object, int]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result, torch.cuda.max_memory_allocated()


def diffusers_fp16(model_dir: Path, prompts) -> dict:
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    transformer = PixArtTransformer2DModel.from_pretrained(model_dir / "transformer", dtype=torch.float16)
    transformer.to("cuda").eval().requires_grad_(False)
    scheduler = DPMSolverMultistepScheduler.from_pretrained(model_dir / "scheduler")
    pipe = PixArtSigmaPipeline(
        tokenizer=None, text_encoder=None, vae=None, transformer=transformer, scheduler=scheduler
    )
    pipe.set_progress_bar_config(disable=True)
    embeds, seed = prompts[0]

    def run():
        with torch.no_grad():
            return pipe(
                negative_prompt=None,
                prompt_embeds=embeds.prompt_embeds.to("cuda", torch.float16),
                prompt_attention_mask=embeds.prompt_mask.to("cuda"),
                negative_prompt_embeds=embeds.negative_embeds.to("cuda", torch.float16),
                negative_prompt_attention_mask=embeds.negative_mask.to("cuda"),
                width=SETTINGS["width"],
                height=SETTINGS["height"],
                num_inference_steps=SETTINGS["steps"],
                guidance_scale=SETTINGS["cfg"],
                generator=torch.Generator("cpu").manual_seed(seed),
                output_type="latent",
                use_resolution_binning=False,
                return_dict=False,
            )[0]

    runs = [timed(run) for _ in range(RUNS)]
    return {
        "seconds": [round(s, 4) for s, _, _ in runs],
        "later": statistics.median(s for s, _, _ in runs[1:]),
        "peak_allocated": max(p for _, _, p in runs[1:]),
    }


def sampler_settings(source, options: dict, seed: int, quant_cache: Path):
    from pixart_lowvram.core.sampler_settings import SamplerSettings

    options = {key: value for key, value in options.items() if key not in SWITCHES}
    return SamplerSettings(
        source, **SETTINGS, seed=seed, device="cuda", keep_loaded=True, quant_cache=quant_cache, **options
    )


@contextlib.contextmanager
def isolated(options: dict):
    """A row on its own: its blocks compiled afresh, ``PIXART_LOWVRAM_FUSED_QUANT`` 1 or 0 where its
    ``options`` say ``"fused"`` (True: the fused quantization kernels, :mod:`pixart_lowvram.core.quant.block`;
    False: each layer quantizes its input; absent: the pack's default), ``PIXART_LOWVRAM_CUDA_GRAPH`` where
    they say ``"graph"`` (True: the steps replayed from a CUDA graph, :mod:`pixart_lowvram.core.step_graph`),
    and its kept transformer dropped after."""
    from pixart_lowvram.core import step_graph
    from pixart_lowvram.core.pool import cache
    from pixart_lowvram.core.quant import block

    torch._dynamo.reset()
    names = {"fused": block.VARIABLE, "graph": step_graph.VARIABLE}
    variables = {names[key]: "1" if value else "0" for key, value in options.items() if key in SWITCHES}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name in variables:
            os.environ.pop(name, None)
        cache.clear()
        torch.cuda.empty_cache()


def pack_row(source, prompts, options: dict, quant_cache: Path, decoder) -> dict:
    """A sampler row: its runs timed on the first prompt, then each prompt's latents and image."""
    from pixart_lowvram.core import sampler, vae

    with isolated(options):
        embeds, seed = prompts[0]
        settings = sampler_settings(source, options, seed, quant_cache)
        runs = [timed(lambda: sampler.sample(settings, embeds)) for _ in range(RUNS)]
        outputs = []
        for embeds, seed in prompts:
            latents = sampler.sample(sampler_settings(source, options, seed, quant_cache), embeds)
            outputs.append((latents, vae.decode(decoder, latents)))
    return {
        "options": options,
        "seconds": [round(s, 4) for s, _, _ in runs],
        "first": runs[0][0],
        "later": statistics.median(s for s, _, _ in runs[1:]),
        "peak_allocated": max(p for _, _, p in runs[1:]),
        "outputs": outputs,
    }


def graph_us(fn, calls: int = 20, repeat: int = 20) -> float:
    """GPU time of one call of ``fn`` in µs: ``calls`` calls captured in a CUDA graph, the median of
    ``repeat`` replays over ``calls`` (without the graph, a call whose launch takes longer on the CPU than its
    kernels on the GPU would be timed by its launch)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return 1000 * median_ms(graph.replay, repeat=repeat, warmup=3) / calls


def fused_kernels() -> list[dict]:
    """Each fused quantization at its 1024² shape (GPU time, µs: :func:`graph_us`), against the same op
    unfused (eager torch: the op, absmax, division, cast) and a copy of its input (one read and one write:
    the floor)."""
    from pixart_lowvram.core.quant import fused, fused_kernels

    rows = []
    torch.manual_seed(0)
    for op, shape in FUSED_SHAPES:
        x = torch.randn(*shape, device="cuda", dtype=torch.float16)
        shift = torch.randn(shape[0], 1, shape[-1], device="cuda", dtype=torch.float16) * 0.1
        scale = torch.randn(shape[0], 1, shape[-1], device="cuda", dtype=torch.float16) * 0.1
        args = (x, shift, scale, 1e-6) if op == "norm_modulate_quantize" else (x,)
        row = {"op": op, "input": list(shape), "copy of the input": graph_us(x.clone)}
        for compute in ("int8", "fp8"):
            kernel, eager = getattr(fused_kernels, op), getattr(fused, op)
            row[f"{compute} fused"] = graph_us(lambda k=kernel, c=compute, a=args: k(*a, c))
            row[f"{compute} eager"] = graph_us(lambda e=eager, c=compute, a=args: e(*a, c))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


# CUDA kernels by what they do: the first kind whose words a kernel's name holds, the rest "other".
# Inductor's kernels come first: they are named after every op they fuse, so the one that quantizes a
# _scaled_mm's input is "triton_red_fused__scaled_mm_…".
KERNEL_KINDS = (
    ("fused quantization (the pack's kernels)", ("quantize_kernel",)),
    ("fused elementwise and norms (inductor)", ("triton_",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matrix products", ("gemm", "cutlass", "nvjet", "sm90_xmma", "scaled_mm", "int_mm", "cublas", "wgmma")),
)


def profile_row(source, prompts, options: dict, quant_cache: Path) -> dict:
    """One later sampler run (20 steps, the transformer kept and compiled) under torch's profiler: CUDA
    kernel time by kind, per transformer forward, the GPU's busy time for the run (all its kernels) and the
    run's wall clock measured without the profiler: a wall clock well above the busy time is a run that
    waits on its launches. Only the kernels count (device-side events): an operator's row carries its
    kernels' time too."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pixart_lowvram.core import sampler

    embeds, seed = prompts[0]
    settings = sampler_settings(source, options, seed, quant_cache)
    with isolated(options):
        for _ in range(2):  # load, compile, warm
            sampler.sample(settings, embeds)
        later = timed(lambda: sampler.sample(settings, embeds))[0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sampler.sample(settings, embeds)
            torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    kernels = [event for event in prof.key_averages() if event.device_type == DeviceType.CUDA]
    for event in kernels:
        if not event.device_time_total or event.key.startswith(("Memcpy", "Memset")):
            continue
        name = event.key.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in name for w in words)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + event.device_time_total / 1000
    forwards = SETTINGS["steps"]
    top = sorted(kernels, key=lambda e: -e.device_time_total)[:12]
    return {
        "options": options,
        "later_seconds": later,
        "gpu_busy_seconds": round(sum(kinds.values()) / 1000, 4),
        "ms_per_forward": {kind: round(ms / forwards, 3) for kind, ms in sorted(kinds.items())},
        "top_kernels": [(e.key[:90], round(e.device_time_total / 1000 / forwards, 3)) for e in top],
    }


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a * 255).round().double() - (b * 255).round().double()).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def fidelity(ours, reference) -> dict:
    cosines = [
        float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))
        for (a, _), (b, _) in zip(ours, reference, strict=True)
    ]
    psnrs = [psnr(x, y) for (_, x), (_, y) in zip(ours, reference, strict=True)]
    return {"latent_cosine": cosines, "image_psnr_db": psnrs}


def fmt(value) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.3f}" if value < 100 else f"{value:.0f}"
    return str(value)


def markdown(result: dict) -> str:
    """Each part's table."""
    lines = []
    layers, fused_rows = result.get("layers"), result.get("fused_kernels")
    if layers:
        keys = list(dict.fromkeys(k for row in layers for k in row if k not in ("in", "out")))
        lines += ["## The block's linear layers at 1024² with guidance (ms, median of 50)", ""]
        lines += harness.table(keys, [[fmt(row.get(k, "–")) for k in keys] for row in layers])
        lines.append("")
    if fused_rows:
        lines += [
            "## The fused quantization kernels at 1024² with guidance (µs of GPU time, CUDA graphs; fused: the "
            "pack's Triton kernel; eager: the same op as separate torch ops; copy: one read and one write of "
            "the input)",
            "",
        ]
        keys = list(fused_rows[0])
        lines += harness.table(keys, [[fmt(row.get(k, "–")) for k in keys] for row in fused_rows])
        lines.append("")
    sampler_rows, s = result.get("sampler"), result["settings"]
    if sampler_rows:
        anchor = sampler_rows.get("diffusers fp16 transformer", {}).get("later")
        lines += [
            f"## The sampler stage alone: {s['width']}², {s['steps']} steps, cfg {s['cfg']}, {s['scheduler']}, "
            "transformer kept loaded",
            "",
        ]
        cells = []
        for name, row in sampler_rows.items():
            if "error" in row:
                cells.append([name, "–", f"failed: {row['error']}", "", "", "", "", ""])
                continue
            fid = row.get("fidelity")
            cos, ps = "–", "–"
            if fid:
                cos = f"{min(fid['latent_cosine']):.5f} / {statistics.mean(fid['latent_cosine']):.5f}"
                ps = f"{fmt(min(fid['image_psnr_db']))} / {fmt(statistics.mean(fid['image_psnr_db']))} dB"
            cells.append(
                [
                    name,
                    json.dumps(row.get("options", {})),
                    f"{row['first']:.2f} s" if "first" in row else "–",
                    f"{row['later']:.3f} s",
                    f"{row['later'] / anchor:.2f}" if anchor else "–",
                    f"{row['peak_allocated'] / GIB:.2f} GiB",
                    cos,
                    ps,
                ]
            )
        header = ["row", "options", "first run", "later (median)", "× fp16 model", "GPU peak allocated"]
        lines += harness.table([*header, "latent cosine min / mean", "image PSNR min / mean"], cells)
        lines += [
            "",
            f"Fidelity: five prompts with their seeds, each path's latents and images against "
            f"{FIDELITY_REFERENCE}'s. Random weights, not trained ones.",
            "",
        ]
    profile = result.get("profile")
    if profile:
        kinds = list(dict.fromkeys(kind for row in profile.values() for kind in row["ms_per_forward"]))
        lines += ["## CUDA kernel time by kind per transformer forward, a later compiled run (ms)", ""]
        cells = [
            [
                name,
                json.dumps(row["options"]),
                f"{row['later_seconds']:.3f} s",
                f"{row['gpu_busy_seconds']:.3f} s",
            ]
            + [fmt(row["ms_per_forward"].get(kind, 0.0)) for kind in kinds]
            for name, row in profile.items()
        ]
        lines += harness.table(["compute", "options", f"{s['steps']} steps", "GPU busy", *kinds], cells)
    return "\n".join(lines) + "\n"


def sampler_part(args, source, prompts, quant_cache: Path, rows: dict, write) -> None:
    """The sampler rows into ``rows``, each 8-bit path's fidelity against :data:`FIDELITY_REFERENCE`."""
    from pixart_lowvram.core import vae

    decoder = vae.DecoderSettings(source, device="cuda")
    rows["diffusers fp16 transformer"] = diffusers_fp16(args.model_dir, prompts)
    torch.cuda.empty_cache()  # its transformer went with its frame
    write()
    outputs = {}
    for name, options in COMPUTE_ROWS.items():
        try:
            row = pack_row(source, prompts, options, quant_cache, decoder)
        except Exception as exc:
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{name}: {exc!r}", file=sys.stderr)
            continue
        outputs[name] = row.pop("outputs")
        if name != FIDELITY_REFERENCE and FIDELITY_REFERENCE in outputs:
            row["fidelity"] = fidelity(outputs[name], outputs[FIDELITY_REFERENCE])
        rows[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "options"}), file=sys.stderr)
        write()


def profile_part(source, prompts, quant_cache: Path, rows: dict, write) -> None:
    from pixart_lowvram.core.quant import compute

    try:
        for name, (options, fast_accumulation) in PROFILE_ROWS.items():
            compute.FAST_ACCUMULATION = fast_accumulation
            rows[name] = profile_row(source, prompts, options, quant_cache)
            write()
    finally:
        compute.FAST_ACCUMULATION = True


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "compute")
    p.add_argument(
        "--part", choices=PARTS, action="append", help="a part to measure (repeatable; all by default)"
    )
    args = harness.parse(p, argv, title=TITLE, render=markdown)
    if args.model_dir is None:
        p.error("give --model-dir")
    if not torch.cuda.is_available():
        p.error("compute measures on a CUDA GPU; none is available")
    from pixart_lowvram.core import models

    parts = args.part or PARTS
    run = harness.run(p, args, packages=("comfy-kitchen",))
    data: dict = {"settings": SETTINGS}

    def write() -> None:
        harness.write(args, data, run=run, title=TITLE, render=markdown)

    source = models.resolve_model(str(args.model_dir))
    quant_cache = Path(tempfile.mkdtemp(prefix="compute-")) / "quant_cache"
    if "kernels" in parts:
        data["layers"] = kernels()
        data["fused_kernels"] = fused_kernels()
        write()
    if "sampler" in parts or "profile" in parts:
        prompts = encode_prompts(source, quant_cache)
    if "sampler" in parts:
        sampler_part(args, source, prompts, quant_cache, data.setdefault("sampler", {}), write)
    if "profile" in parts:
        profile_part(source, prompts, quant_cache, data.setdefault("profile", {}), write)
    result = harness.write(args, data, run=run, title=TITLE, render=markdown)
    print(harness.markdown_text(TITLE, result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
