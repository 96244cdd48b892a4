"""Where a KSampler prompt run again parts from its first run: the same sampling (core's
``comfy.sample.sample``, what KSampler runs) repeated in one process with ComfyUI as a library, every
module's output of every forward hashed on the device, and the first place the runs differ named.

Per configuration the prompts run A, B, A, A (B another seed and conditioning, as a server's queue has it
between two equal prompts). For each run of A: a hash of each forward's inputs (latent, timestep, context),
of each module's output in execution order (forward hooks on the diffusion model's modules; an exact
integer hash of the bits, computed on the device) and of the final latent. The report says, for runs 2
and 3 of A against run 1, the first forward and the first module whose output differs (or "same"), the
inputs' hashes there, the final latents' largest difference, and how the run held its weights (free
memory before the run).

Configurations (``--only``, repeatable; all by default): ``pack MODEL`` (the int8 Model Loader's MODEL,
batched guidance), ``pack MODEL, two passes``, ``core fp16``, ``core fp16 + Batched Guidance``.
``--deterministic`` runs as ComfyUI's ``--deterministic`` does (``torch.use_deterministic_algorithms(True,
warn_only=True)``); a CUBLAS_WORKSPACE_CONFIG in the environment reaches cuBLAS as it would a server's.

On the GPU machine (see benchmarks/profile_ksampler.py for the set-up)::

    python benchmarks/repeat_ksampler.py --comfyui ComfyUI --model-dir pixart-full --out DIR [--dynamic-vram]

On a CPU machine ``--preset tiny --size 272 --steps 2`` checks the script.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_lora import arguments, comfy_modules, ksample, model_here, random_embeds  # noqa: E402
from profile_ksampler import digest  # noqa: E402

CONFIGS = ("pack MODEL", "pack MODEL, two passes", "core fp16", "core fp16 + Batched Guidance")
ORDER = (0, 1, 0, 0)  # the prompts' seeds and conditionings: A, B, A, A


def bits_hash(tensor: torch.Tensor) -> torch.Tensor:
    """An exact hash of a tensor's bits on its device (integer sums do not depend on their order)."""
    flat = tensor.detach().contiguous().view(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    values = flat.view(ints).to(torch.int64)
    weights = torch.arange(values.numel(), device=values.device, dtype=torch.int64) % 65521 + 1
    return (values * weights).sum()


class Recorder:
    """Forward hooks on every module of the diffusion model and a unet function wrapper for the inputs."""

    def __init__(self, diffusion_model: torch.nn.Module):
        self.layers = [(n, m) for n, m in diffusion_model.named_modules() if hasattr(m, "weight_scale")]
        self.active = False
        self.forwards: list[dict] = []
        self.calls: list[dict] = []
        self.runs_seen: list[int] = []
        self.handles = [
            module.register_forward_hook(self._hook(name))
            for name, module in diffusion_model.named_modules()
            if name
        ]

    def _hook(self, name):
        def hook(_module, _inputs, output):
            if self.active and isinstance(output, torch.Tensor) and self.forwards:
                self.forwards[-1]["outputs"].append((name, bits_hash(output)))

        return hook

    def attention(self, function):
        """ComfyUI's attention call (``comfy.ops.scaled_dot_product_attention``), its outputs hashed too."""

        def attend(*args, **kwargs):
            order = torch._C._get_sdp_priority_order()
            out = function(*args, **kwargs)
            if self.active and self.forwards:
                self.forwards[-1]["outputs"].append(("scaled_dot_product_attention", bits_hash(out)))
                if len(self.forwards) == 1 and len(self.calls) < 2 * (len(self.runs_seen) + 1):
                    self.calls.append(self.explain(function, order, out, args, kwargs))
            return out

        return attend

    def explain(self, function, order, out, args, kwargs) -> dict:
        """One attention call taken apart: its inputs' layout, the backend order it met, whether it repeats
        its own bits, and which backend's result it equals."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = args[:3]
        again = function(*args, **kwargs)
        same_as = []
        for backend in (
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
        ):
            try:
                with sdpa_kernel([backend]):
                    ref = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
                if torch.equal(ref, out):
                    same_as.append(backend.name)
            except RuntimeError:
                pass
        return {
            "run": len(self.runs_seen),
            "shapes": [tuple(t.shape) for t in (q, k, v)],
            "strides": [t.stride() for t in (q, k, v)],
            "ptr_mod_1024": [t.data_ptr() % 1024 for t in (q, k, v)],
            "priority_before": order,
            "repeats_itself": bool(torch.equal(again, out)),
            "equals_backend": same_as,
        }

    def __call__(self, apply_model, args):
        if self.active:
            c = args["c"]
            context = c.get("c_crossattn")
            self.forwards.append(
                {
                    "inputs": {
                        "x": bits_hash(args["input"]),
                        "t": bits_hash(args["timestep"]),
                        "context": bits_hash(context) if context is not None else torch.zeros(()),
                        "shape": tuple(args["input"].shape)
                        + (tuple(context.shape) if context is not None else ()),
                    },
                    "outputs": [],
                    "weights": [
                        (f"{name}.{kind}", bits_hash(tensor))
                        for name, layer in self.layers
                        for kind in ("weight", "weight_dense")
                        if isinstance(tensor := getattr(layer, kind, None), torch.Tensor)
                    ]
                    if not self.forwards
                    else [],
                }
            )
        out = apply_model(args["input"], args["timestep"], **args["c"])
        if self.active:
            self.forwards[-1]["out"] = bits_hash(out)
        return out

    def take(self) -> list[dict]:
        taken = []
        for forward in self.forwards:
            inputs = forward["inputs"]
            taken.append(
                {
                    "inputs": {k: (v if k == "shape" else int(v)) for k, v in inputs.items()},
                    "outputs": [(name, int(h)) for name, h in forward["outputs"]],
                    "weights": [(name, int(h)) for name, h in forward["weights"]],
                    "out": int(forward["out"]),
                }
            )
        self.forwards = []
        self.runs_seen.append(len(self.runs_seen))
        return taken

    def remove(self):
        for handle in self.handles:
            handle.remove()


def first_difference(one: list[dict], other: list[dict]) -> dict:
    for index, (a, b) in enumerate(zip(one, other, strict=False)):
        for (name, ha), (_name, hb) in zip(a["weights"], b["weights"], strict=False):
            if ha != hb:
                return {"forward": index, "where": f"the layer tensor {name}"}
        if a["inputs"] != b["inputs"]:
            which = [k for k in a["inputs"] if a["inputs"][k] != b["inputs"][k]]
            return {"forward": index, "where": f"inputs ({', '.join(which)})"}
        for (name, ha), (_name, hb) in zip(a["outputs"], b["outputs"], strict=False):
            if ha != hb:
                return {"forward": index, "where": name}
        if len(a["outputs"]) != len(b["outputs"]):
            return {"forward": index, "where": "a different set of module calls"}
        if a["out"] != b["out"]:
            return {"forward": index, "where": "the model's output (after the hooked modules)"}
    if len(one) != len(other):
        return {"forward": min(len(one), len(other)), "where": "a different number of forwards"}
    return {"forward": None, "where": "same"}


def run_config(name, model, comfy, args, embeds) -> dict:

    model = model.clone()
    recorder = Recorder(model.model.diffusion_model)
    model.set_model_unet_function_wrapper(recorder)
    latent = torch.zeros(1, 4, args.size // 8, args.size // 8)
    runs, finals, free = [], [], []
    device = comfy.model_management.get_torch_device()
    attention = comfy.ops.scaled_dot_product_attention
    comfy.ops.scaled_dot_product_attention = recorder.attention(attention)
    if args.preload:
        comfy.model_management.load_models_gpu([model])
    for index, which in enumerate(ORDER):
        recorder.active = which == 0
        free.append(comfy.model_management.get_free_memory(device))
        latents = ksample(comfy, model, 1000 + which, embeds[which], latent, args.steps, args.cfg)
        if which == 0:
            runs.append(recorder.take())
            finals.append(latents.float().cpu())
        print(f"{name}: prompt {index + 1} {digest(latents)}", flush=True)
    recorder.remove()
    comfy.ops.scaled_dot_product_attention = attention
    row = {
        "name": name,
        "free_before_each_prompt": free,
        "attention_calls": recorder.calls,
        "against_first": [],
    }
    for call in recorder.calls:
        print(f"{name}: {call}", flush=True)
    for run, final in zip(runs[1:], finals[1:], strict=True):
        diff = first_difference(runs[0], run)
        diff["final_max_abs_diff"] = float((final - finals[0]).abs().max())
        diff["forwards"] = len(run)
        if diff["forward"] is not None:
            diff["inputs_first"] = runs[0][diff["forward"]]["inputs"]
            diff["inputs_this"] = run[diff["forward"]]["inputs"]
        row["against_first"].append(diff)
        print(f"{name}: {diff}", flush=True)
    return row


def sigmas_check(comfy, steps: int) -> dict:
    """KSampler's sigmas (``calculate_sigmas``, "normal") from a PixArt model sampling held on the CPU and
    on the device: ComfyUI computes them wherever the model's buffers are."""
    import comfy.model_base
    import comfy.samplers
    import comfy.supported_models

    config = comfy.supported_models.PixArtSigma({"image_model": "pixart_sigma"})
    sampling = comfy.model_base.model_sampling(config, comfy.model_base.ModelType.EPS)
    cpu = comfy.samplers.calculate_sigmas(sampling, "normal", steps)
    device = comfy.model_management.get_torch_device()
    there = comfy.samplers.calculate_sigmas(sampling.to(device), "normal", steps).cpu()
    return {
        "equal": bool(torch.equal(cpu, there)),
        "steps_differing": int((cpu != there).sum()),
        "max_abs_diff": float((cpu - there).abs().max()),
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument(
        "--preload", action="store_true", help="load each MODEL onto the device before its first prompt"
    )
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, default=4.5)
    parser.add_argument("--stem", default="repeat_ksampler")
    parser.add_argument("--only", action="append", default=[], choices=CONFIGS)
    args = parser.parse_args()

    comfy, int8_model = comfy_modules(args.comfyui, args.dynamic_vram)
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    import importlib

    batched_guidance = importlib.import_module("pixart_lowvram.nodes.batched_guidance")
    guidance = importlib.import_module("pixart_lowvram.nodes.int8_model.guidance")
    from pixart_lowvram.core import sampler
    from pixart_lowvram.core.models import resolve_model

    device = model_here(args.model_dir, args.preset)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = sampler.SamplerSettings(
        resolve_model(str(args.model_dir), []),
        width=args.size,
        height=args.size,
        steps=args.steps,
        cfg=args.cfg,
        quantization="qint8",
        device=device,
        quant_cache=args.out / "work" / "quantized",
    )
    embeds = [random_embeds(i, settings.caption_channels) for i in range(2)]
    wanted = args.only or list(CONFIGS)
    rows = []
    if any(name.startswith("pack") for name in wanted):
        pack = int8_model.load(settings.transformer, settings.keep_loaded)
        plain = pack.clone()
        plain.model_options.pop(guidance.KEY, None)
        models = {"pack MODEL": pack, "pack MODEL, two passes": plain}
        rows += [run_config(n, models[n], comfy, args, embeds) for n in wanted if n in models]
        del pack, plain, models
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()
    if any(name.startswith("core") for name in wanted):
        from safetensors.torch import load_file

        state = load_file(args.model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
        core = comfy.sd.load_diffusion_model_state_dict(state)
        models = {
            "core fp16": core,
            "core fp16 + Batched Guidance": batched_guidance.PixArtBatchedGuidance.execute(core).result[0],
        }
        rows += [run_config(n, models[n], comfy, args, embeds) for n in wanted if n in models]
    result = {
        "sigmas_cpu_vs_device": sigmas_check(comfy, args.steps),
        "preload": args.preload,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "dynamic_vram": args.dynamic_vram,
        "deterministic": args.deterministic,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "size": args.size,
        "steps": args.steps,
        "cfg": args.cfg,
        "rows": rows,
    }
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
