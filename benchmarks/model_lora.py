"""The pack's int8 MODEL under core's KSampler, and LoRA on the int8 transformer, beside the Quanto PixArt
Sampler, in one process with ComfyUI as a library (the full-size architecture with random weights, 1024²,
20 steps, cfg 4.5; later prompt = the mean of prompts 2 to N, each prompt its own seed):

- ``pack sampler``: the Quanto PixArt Sampler's core (``sampler.sample``, dpmsolver++, qint8,
  keep_loaded so the transformer stays on the GPU between prompts as ComfyUI keeps a MODEL);
- ``pack sampler + LoRA``: the same with a rank-``--rank`` LoRA on every attention and feed-forward layer;
- ``KSampler, pack MODEL``: core's sampling (``comfy.sample.sample``, what KSampler runs; dpmpp_2m/normal,
  the nearest to dpmsolver++) on the PixArt-Σ int8 Model Loader's MODEL;
- ``KSampler, pack MODEL, two passes``: the same without its batched guidance (ComfyUI's own batching:
  a prompt and a negative of different token counts as two forwards a step); ``…, cfg 1``: one pass a step;
- ``KSampler, pack MODEL + LoRA``: the same MODEL through core's LoRA loading
  (``comfy.sd.load_lora_for_models``, what LoraLoaderModelOnly runs);
- ``KSampler, core fp16 MODEL``: core's own PixArt-Σ of the same weights in fp16
  (``comfy.sd.load_diffusion_model_state_dict``, what Load Diffusion Model runs), and with the pack's
  Batched Guidance (PixArt-Σ) node's patch.

Fidelity: latents of ``KSampler, pack MODEL`` against ``KSampler, core fp16 MODEL`` (same sampler, seed and
conditioning), and of ``pack sampler + LoRA`` against diffusers' pipeline on fp32 weights with the same
LoRA merged into them (the oracle), as cosine similarities.

``--dynamic-vram`` starts ComfyUI's Dynamic VRAM as its main.py does (comfy-aimdo), so the MODELs are
``ModelPatcherDynamic``s; without it, ComfyUI's ordinary loading. The conditioning is random (T5 is not
part of what is compared); the model folder is built when missing (transformer, scheduler and VAE only).

    python benchmarks/model_lora.py --comfyui /path/to/ComfyUI --model-dir pixart-full [--dynamic-vram]

Writes model_lora.json and model_lora.md to --out (benchmarks/results): one part for ComfyUI's ordinary
loading and one for Dynamic VRAM, a run replacing its own. On a CPU machine ``--preset tiny-core --size 272
--steps 2 --out DIR`` checks the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import tempfile
import time
import types
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

REPO = harness.REPO
GIB = harness.GIB
TITLE = "The pack's int8 MODEL and LoRA beside the Quanto PixArt Sampler"


def arguments(doc: str, name: str, prompts: int) -> argparse.ArgumentParser:
    """The arguments of the KSampler benchmarks here: the harness's (the ComfyUI checkout, the model folder
    (see :func:`model_here`), size, steps, the output), Dynamic VRAM, the random model's size, the prompts,
    the LoRA's rank and a work folder."""
    parser = harness.parser(doc, name, comfyui=True, size=harness.SIZE, steps=harness.STEPS)
    parser.add_argument("--dynamic-vram", action="store_true", help="ComfyUI's Dynamic VRAM (comfy-aimdo)")
    parser.add_argument("--preset", default="full", help="the random model's size when it is built")
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--rank", type=int, default=16, help="the random LoRA's rank")
    parser.add_argument(
        "--work", type=Path, help="the folder for the LoRA and the quantized cache (default: a temporary one)"
    )
    return parser


def model_here(model_dir: Path, preset: str) -> str:
    """The device to run on ("cuda" where there is one), the transformer-only random model of ``preset``
    built in ``model_dir`` first (fp16 on CUDA) when the folder holds no model."""
    from pixart_lowvram.cli.random_model import build_random_pixart

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (model_dir / "model_index.json").is_file():
        dtype = torch.float16 if device == "cuda" else torch.float32
        build_random_pixart(model_dir, preset, device=device, dtype=dtype, text_encoder=False)
    return device


def ksampler_settings(args, **choices):
    """What the KSampler scripts sample with: the device, the random model in ``args.model_dir`` (built when
    missing), a random rank-``args.rank`` LoRA of it in ``args.out``/work, and the settings (qint8,
    ``args.size``², ``args.steps`` steps, cfg 4.5, the quantized cache in ``args.out``/work; ``choices``
    replace any of them). Returns ``(device, lora_path, settings)``."""
    from pixart_lowvram.cli.random_model import save_random_lora
    from pixart_lowvram.core import sampler
    from pixart_lowvram.core.models import resolve_model

    device = model_here(args.model_dir, args.preset)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"{args.benchmark}-"))
    lora_path = save_random_lora(args.model_dir, work / "lora.safetensors", rank=args.rank, scale=0.02)
    settings = sampler.SamplerSettings(
        resolve_model(str(args.model_dir), []),
        width=args.size,
        height=args.size,
        steps=args.steps,
        cfg=4.5,
        quantization="qint8",
        device=device,
        quant_cache=work / "quantized",
    )
    return device, lora_path, dataclasses.replace(settings, **choices)


def comfy_modules(comfyui: Path, dynamic: bool):
    """ComfyUI's modules from the checkout, with Dynamic VRAM started as main.py starts it when asked."""
    sys.path.insert(0, str(comfyui))
    import comfy.cli_args

    if not torch.cuda.is_available():  # a dry run of the script on a CPU machine (--preset tiny)
        comfy.cli_args.args.cpu = True
    if dynamic:  # comfy-aimdo starts before CUDA does, as in main.py
        import comfy_aimdo.control

        try:
            comfy_aimdo.control.init(simple_vram_headroom=None, nvml_pressure=True)
        except TypeError:
            comfy_aimdo.control.init()
    import comfy.model_management
    import comfy.model_patcher

    if dynamic:
        import comfy.memory_management

        devices = comfy.model_management.get_all_torch_devices()
        headroom = int(comfy.cli_args.args.vram_headroom * GIB)
        try:
            ready = comfy_aimdo.control.init_devices((d.index, headroom) for d in devices)
        except TypeError:
            ready = comfy_aimdo.control.init_devices(d.index for d in devices)
        if not ready:
            raise SystemExit("comfy-aimdo did not start: no Dynamic VRAM here")
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
    import comfy.sample
    import comfy.sd
    import comfy.utils

    # The pack's MODEL module, without the node registry beside it (which imports ComfyUI's server API).
    nodes = types.ModuleType("pixart_lowvram.nodes")
    nodes.__path__ = [str(REPO / "nodes")]
    sys.modules["pixart_lowvram.nodes"] = nodes
    return comfy, importlib.import_module("pixart_lowvram.nodes.int8_model")


def random_embeds(seed: int, width: int):
    from pixart_lowvram.core.contract import PixArtEmbeds

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randn(1, 300, width, generator=g) * 0.2
    mask = torch.zeros(1, 300, dtype=torch.long)
    mask[:, :24] = 1
    negative = torch.randn(1, 300, width, generator=g) * 0.2
    negative_mask = torch.zeros(1, 300, dtype=torch.long)
    negative_mask[:, :1] = 1
    return PixArtEmbeds(prompt, mask, negative, negative_mask, "random", "none", torch.float16)


def ksample(comfy, model, seed: int, embeds, latent, steps: int, cfg: float, **extra) -> torch.Tensor:
    """KSampler's sampling as its node runs it (``comfy.sample.sample``: dpmpp_2m, normal, full denoise) of
    ``embeds`` (the pack's PixArt embeddings, as core's conditioning) from ``seed``'s noise."""
    from pixart_lowvram.core import conditioning

    positive, negative = conditioning.core_conditioning(embeds)
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(
        model,
        noise,
        steps,
        cfg,
        "dpmpp_2m",
        "normal",
        positive,
        negative,
        latent,
        denoise=1.0,
        seed=seed,
        **extra,
    )


def measure(name: str, run, prompts: int) -> dict:
    """Run ``run(i)`` for prompts 0..N-1: seconds and peak allocated of each, its last output kept."""
    seconds, peaks, out = [], [], None
    cuda = torch.cuda.is_available()
    for i in range(prompts):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = run(i)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated() if cuda else 0)
    later = seconds[1:] or seconds
    row = {
        "name": name,
        "seconds": seconds,
        "later": sum(later) / len(later),
        "peak_gib": max(peaks) / GIB,
        "later_peak_gib": max(peaks[1:] or peaks) / GIB,
    }
    print(f"{name}: later {row['later']:.3f} s, peak {row['later_peak_gib']:.2f} GiB", flush=True)
    return row | {"latents": out}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double().cpu(), b.flatten().double().cpu(), dim=0).item()


def merged_oracle(model_dir: Path, lora_path: Path, embeds, settings, seed: int) -> torch.Tensor:
    """diffusers' pipeline on the fp32 transformer with the LoRA merged into its weights."""
    from diffusers import PixArtSigmaPipeline, PixArtTransformer2DModel
    from safetensors.torch import load_file

    from pixart_lowvram.cli.random_model import LORA_FORMATS
    from pixart_lowvram.core import sampler

    transformer = PixArtTransformer2DModel.from_pretrained(model_dir / "transformer", dtype=torch.float32)
    state = load_file(lora_path)
    prefix, up, down, _alpha = LORA_FORMATS["peft"]
    with torch.no_grad():
        for name, module in transformer.named_modules():
            if prefix + name + up in state:
                module.weight += state[prefix + name + up].float() @ state[prefix + name + down].float()
    pipe = PixArtSigmaPipeline.from_pretrained(
        model_dir, transformer=transformer, text_encoder=None, tokenizer=None, vae=None
    ).to(settings.device)
    pipe.set_progress_bar_config(disable=True)
    latents = pipe(
        negative_prompt=None,
        prompt_embeds=embeds.prompt_embeds.to(settings.device, torch.float32),
        prompt_attention_mask=embeds.prompt_mask.to(settings.device),
        negative_prompt_embeds=embeds.negative_embeds.to(settings.device, torch.float32),
        negative_prompt_attention_mask=embeds.negative_mask.to(settings.device),
        generator=torch.Generator("cpu").manual_seed(seed),
        width=settings.width,
        height=settings.height,
        num_inference_steps=settings.steps,
        guidance_scale=settings.cfg,
        use_resolution_binning=False,
        output_type="latent",
    ).images
    del pipe, transformer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return latents.float().cpu() / sampler.scaling_factor(settings.model)


def markdown(result: dict) -> str:
    """Each loading's table (later prompt and peak against the pack's sampler) and its latents compared."""
    lines = []
    for mode, part in result["rows"].items():
        rows = part["rows"]
        base = next(row for row in rows if row["name"] == "pack sampler")
        lines += [
            f"## {mode} (run {harness.run_of(result, part)}): {part['patcher']}, {part['size']}², "
            f"{part['steps']} steps, a rank-{part['rank']} LoRA",
            "",
        ]
        cells = [
            [
                row["name"],
                f"{row['later']:.3f} s",
                f"{row['later'] / base['later']:.2f}",
                f"{row['later_peak_gib']:.2f} GiB",
                f"{row['later_peak_gib'] / max(base['later_peak_gib'], 1e-9):.2f}",
            ]
            for row in rows
        ]
        header = ["configuration", "later prompt", "× pack sampler", "peak allocated", "× pack sampler"]
        lines += [*harness.table(header, cells), ""]
        fidelity = [[name, f"{value:.6f}"] for name, value in part["fidelity"].items()]
        lines += [*harness.table(["latents compared", "cosine"], fidelity), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "model_lora", prompts=5)
    args = harness.parse(parser, argv, title=TITLE, render=markdown, required=("comfyui", "model_dir"))
    run = harness.run(parser, args, args.comfyui)

    comfy, int8_model = comfy_modules(args.comfyui, args.dynamic_vram)
    batched_guidance = importlib.import_module("pixart_lowvram.nodes.batched_guidance")
    guidance = importlib.import_module("pixart_lowvram.nodes.int8_model.guidance")
    from pixart_lowvram.core import lora, sampler
    from pixart_lowvram.core.transformer import quantized_transformer

    device, lora_path, settings = ksampler_settings(args, keep_loaded=True)
    embeds = [random_embeds(i, settings.caption_channels) for i in range(args.prompts)]
    seed = lambda i: 1000 + i  # noqa: E731
    rows = []

    with_lora = dataclasses.replace(settings, loras=(lora.LoraSpec(lora_path, 1.0),))
    quantized_transformer(settings.transformer)  # the pre-quantized cache, written once: not timed
    rows.append(
        measure(
            "pack sampler",
            lambda i: sampler.sample(dataclasses.replace(settings, seed=seed(i)), embeds[i]),
            args.prompts,
        )
    )
    rows.append(
        measure(
            "pack sampler + LoRA",
            lambda i: sampler.sample(dataclasses.replace(with_lora, seed=seed(i)), embeds[i]),
            args.prompts,
        )
    )
    rows.append(
        measure(
            "pack sampler, cfg 1",
            lambda i: sampler.sample(dataclasses.replace(settings, seed=seed(i), cfg=1.0), embeds[i]),
            args.prompts,
        )
    )
    from pixart_lowvram.core.pool import free_all

    free_all()

    def ksampler(model, cfg=4.5):
        latent = torch.zeros(1, 4, args.size // 8, args.size // 8)

        def run(i):
            return ksample(comfy, model, seed(i), embeds[i], latent, args.steps, cfg)

        return run

    def two_passes(model):
        """The MODEL without the pack's batched guidance: ComfyUI runs a prompt and a negative of different
        token counts as two batch-1 forwards a step."""
        plain = model.clone()
        plain.model_options.pop(guidance.KEY, None)
        return plain

    pack_model = int8_model.load(settings.transformer, settings.keep_loaded)
    kind = type(pack_model).__name__
    rows.append(measure("KSampler, pack MODEL", ksampler(pack_model), args.prompts))
    rows.append(measure("KSampler, pack MODEL, two passes", ksampler(two_passes(pack_model)), args.prompts))
    # cfg 1: one pass a step (ComfyUI leaves the negative out), the time guidance's second half costs.
    rows.append(measure("KSampler, pack MODEL, cfg 1", ksampler(pack_model, 1.0), args.prompts))
    lora_state = comfy.utils.load_torch_file(str(lora_path), safe_load=True)
    pack_lora, _ = comfy.sd.load_lora_for_models(pack_model, None, lora_state, 1.0, 0)
    rows.append(measure("KSampler, pack MODEL + LoRA", ksampler(pack_lora), args.prompts))
    del pack_lora, pack_model
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()

    from safetensors.torch import load_file

    fp16_state = load_file(args.model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    core_model = comfy.sd.load_diffusion_model_state_dict(fp16_state)
    rows.append(measure("KSampler, core fp16 MODEL", ksampler(core_model), args.prompts))
    patched = batched_guidance.PixArtBatchedGuidance.execute(core_model).result[0]
    rows.append(measure("KSampler, core fp16 MODEL + Batched Guidance", ksampler(patched), args.prompts))
    del core_model, patched
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()

    last = args.prompts - 1
    oracle = merged_oracle(
        args.model_dir, lora_path, embeds[last], dataclasses.replace(settings, seed=seed(last)), seed(last)
    )
    by = {row["name"]: row for row in rows}
    fidelity = {
        "KSampler pack MODEL vs core fp16 MODEL": cosine(
            by["KSampler, pack MODEL"]["latents"], by["KSampler, core fp16 MODEL"]["latents"]
        ),
        "KSampler pack MODEL batched vs two passes": cosine(
            by["KSampler, pack MODEL"]["latents"], by["KSampler, pack MODEL, two passes"]["latents"]
        ),
        "KSampler core fp16 MODEL with vs without Batched Guidance": cosine(
            by["KSampler, core fp16 MODEL + Batched Guidance"]["latents"],
            by["KSampler, core fp16 MODEL"]["latents"],
        ),
        "pack sampler + LoRA vs diffusers fp32 merged": cosine(by["pack sampler + LoRA"]["latents"], oracle),
        "pack sampler with vs without LoRA": cosine(
            by["pack sampler + LoRA"]["latents"], by["pack sampler"]["latents"]
        ),
        "KSampler pack MODEL with vs without LoRA": cosine(
            by["KSampler, pack MODEL + LoRA"]["latents"], by["KSampler, pack MODEL"]["latents"]
        ),
    }
    mode = "Dynamic VRAM" if args.dynamic_vram else "ordinary loading"
    part = {
        "patcher": kind,
        "dynamic_vram": args.dynamic_vram,
        "device": device,
        "size": args.size,
        "steps": args.steps,
        "rank": args.rank,
        "rows": [{k: v for k, v in row.items() if k != "latents"} for row in rows],
        "fidelity": fidelity,
    }
    result = harness.write(args, {"rows": {mode: part}}, run=run, title=TITLE, render=markdown, merge="rows")
    print(harness.markdown_text(TITLE, result, markdown))


if __name__ == "__main__":
    main()
