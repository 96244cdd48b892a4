"""Per prompt, from the first on: five prompts, each with its own text and seed, then the first again, in
one process per configuration and through a running ComfyUI server, beside the anchor (diffusers'
PixArtSigmaPipeline in fp16 with everything on the GPU, loading not timed) measured in the same run.

The rows are :data:`CONFIGS`: in one process (``--model-dir``, the full-size model) the pack's stages as
the library runs them (the host-memory pool on, PyTorch's expandable segments as the command line sets
them) with its options (``fast``, ``step_cache``, ``compute``, low VRAM, allocator caps; the lossy ones with
their fidelity against ``pack defaults``), and ComfyUI core's own nodes as a library, told the card has
8 GB; through a server (``--comfyui``, a fresh server per row, its defaults) each bundled API workflow as
shipped or changed as the row says, the LoRA workflow with a random rank-16 LoRA, and core's own fp16
graph (CLIPLoader, UNETLoader, KSampler, VAELoader, VAEDecode, SaveImage on single files of the same
weights), with the pack's Batched Guidance node and with ``--disable-dynamic-vram``.
``$COMFYUI_EXTRA_ARGS`` goes on the server's command line (e.g. ``--disable-api-nodes --front-end-root
DIR``); the server rows need ComfyUI's requirements and websocket-client in this Python.

Per prompt: seconds (through a server, submit to image downloaded) and each stage's seconds and peaks
(through a server, from the pack's log lines), GPU peak allocated and reserved, host RSS (the server's
whole process tree), the bytes copied from host memory to the GPU and what the host-memory pool holds;
through a server also the card's used memory, each node's seconds (the websocket), ComfyUI's own time and
the host's CPU during the prompt. For the anchor also the seconds its image takes to write as SaveImage
writes it (PNG, level 4; not in its seconds). The sixth image must equal the first bit for bit.

    python benchmarks/warm.py --model-dir pixart-full --comfyui ComfyUI --only "pack defaults" \\
        --only "server: pack defaults"

The rows a run measures replace those of the same name in benchmarks/results/warm.json (and warm.md); the
others stay, each naming its run. ``--rounds N``: server rows run prompts 2–5 again N − 1 times, each
round's image equal to its first round's. ``--interleave``: the server rows' servers all up at once, each
prompt on each in turn (the order rotated each prompt), compared prompt by prompt. ``--until SECONDS``: no
round starts that would end later. ``--profile``: torch profiler tables of the third prompt of each
one-process row, in benchmarks/traces/warm/. ``--cpu-check``: server rows on a CPU server, 272², 2 steps
(core's graph takes the pack's T5 encode and VAE decode there), e.g. with ``build_random_pixart(DIR,
"tiny-core")``. ``--self-check``: the rounds, the time limit and the interleaved comparison checked without
a GPU or a server.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import harness
import torch

GIB = harness.GIB
SETTINGS = {"width": harness.SIZE, "height": harness.SIZE, "steps": harness.STEPS, "cfg": harness.CFG}
PROMPTS = harness.PROMPTS
REPEAT = PROMPTS[0]  # the sixth prompt: the first's text and seed again
REPEAT_INDEX = len(PROMPTS)
ROUND = len(PROMPTS) - 1  # the prompts of each round past the first: 2–5
TITLE = "Per prompt, from the first on"


def sequence(rounds: int = 1) -> list[tuple[str, int]]:
    """The prompts a row runs: the five, the first again, then for each round past the first prompts 2–5
    again (each round's prompt follows a different one, so ComfyUI's cache of the last prompt reruns it)."""
    return [*PROMPTS, REPEAT] + PROMPTS[1:] * (rounds - 1)


def rounds_by(rounds: int, until: float | None = None):
    """``enumerate(sequence(rounds))``, but where ``until`` (a ``time.time()``) is given a round past the
    first starts only where, at the pace so far, it ends by then: a run with a time limit keeps whole
    rounds."""
    began = time.time()
    for index, item in enumerate(sequence(rounds)):
        if until and index > REPEAT_INDEX and (index - REPEAT_INDEX - 1) % ROUND == 0:
            pace = (time.time() - began) / index
            if time.time() + pace * ROUND > until:
                return
        yield index, item


def later_records(records: list[dict]) -> list[dict]:
    """A row's later prompts: 2–5 and every further round's (not the first, not the repeat)."""
    return records[1:REPEAT_INDEX] + records[REPEAT_INDEX + 1 :]


LORA_FILE = "random_rank16_lora.safetensors"  # the LoRA rows' LoRA, written into the server's models/loras
# --cpu-check: the server rows on a CPU server with a small model, at this size and these steps.
CPU_CHECK = {"size": 272, "steps": 2}
STEP_CACHE = (0.05, 0.1, 0.2)  # the sampler's step_cache thresholds measured

# PyTorch's expandable segments, as the command line asks for them (core.measure.prefer_expandable_segments).
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
CONFIGS: dict[str, dict] = {
    "anchor: diffusers fp16, all on the GPU": {"kind": "anchor"},
    "pack defaults": {"kind": "pack", "env": EXPANDABLE},
    "pack defaults, PyTorch's default segments": {"kind": "pack"},
    "pack defaults, 3.0 GiB cap": {"kind": "pack", "cap_gib": 3.0, "env": EXPANDABLE},
    "pack fast": {"kind": "pack", "fast": True, "env": EXPANDABLE},
    **{
        f"pack step_cache {threshold:g}": {
            "kind": "pack",
            "step_cache": threshold,
            "env": EXPANDABLE,
            "fidelity_vs": "pack defaults",
        }
        for threshold in STEP_CACHE
    },
    # The sampler's 8-bit compute paths (benchmarks/compute.py measures the stage alone), with their
    # fidelity against the fp16 compute of the defaults.
    **{
        f"pack compute {compute}": {
            "kind": "pack",
            "compute": compute,
            "env": EXPANDABLE,
            "fidelity_vs": "pack defaults",
        }
        for compute in ("int8", "fp8")
    },
    "pack low-VRAM, 1.0 GiB cap": {"kind": "pack", "low_vram": True, "cap_gib": 1.0, "env": EXPANDABLE},
    "pack low-VRAM + fast, 1.0 GiB cap": {
        "kind": "pack",
        "low_vram": True,
        "fast": True,
        "cap_gib": 1.0,
        "env": EXPANDABLE,
    },
    # ComfyUI's allocator choice on NVIDIA (its cuda_malloc.py), set before torch loads as main.py sets it.
    "ComfyUI core, card told 8 GB": {
        "kind": "core",
        "card_gb": 8.0,
        "env": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    },
    "server: pack defaults": {"kind": "server"},
    "server: pack defaults, no Memory Snapshot": {"kind": "server", "no_snapshot": True},
    # fast with compute fp16, as the one-process rows (the workflows' compute auto is fp8 with fast on Hopper).
    "server: pack fast": {"kind": "server", "sets": ["2.fast=true", "2.compute=fp16"]},
    "server: pack fast + step_cache 0.1": {
        "kind": "server",
        "sets": ["2.fast=true", "2.step_cache=0.1", "2.compute=fp16"],
    },
    "server: pack compute fp8": {"kind": "server", "sets": ["2.compute=fp8"]},
    "server: pack compute fp8, no Memory Snapshot": {
        "kind": "server",
        "sets": ["2.compute=fp8"],
        "no_snapshot": True,
    },
    "server: pack low-VRAM": {"kind": "server", "workflow": "pixart_lowvram_low_vram_api.json"},
    "server: pack keep_loaded": {"kind": "server", "keep": True},
    # The pack's int8 MODEL under core's KSampler: the bundled LoRA workflow without its LoRA loader.
    "server: pack int8 MODEL, core KSampler": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "drop": ("LoraLoaderModelOnly",),
    },
    "server: pack int8 MODEL compute fp8, core KSampler": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "drop": ("LoraLoaderModelOnly",),
        "sets": ["2.compute=fp8"],
    },
    # The two fp8 rows above with each layer quantizing its own input (the fused kernels, core/quant/block.py,
    # run by default where Triton does), set in the server.
    "server: pack compute fp8 unfused, no Memory Snapshot": {
        "kind": "server",
        "sets": ["2.compute=fp8"],
        "no_snapshot": True,
        "env": {"PIXART_LOWVRAM_FUSED_QUANT": "0"},
    },
    "server: pack int8 MODEL compute fp8 unfused, core KSampler": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "drop": ("LoraLoaderModelOnly",),
        "sets": ["2.compute=fp8"],
        "env": {"PIXART_LOWVRAM_FUSED_QUANT": "0"},
    },
    # The bundled LoRA workflow as shipped (the int8 MODEL, core's LoraLoaderModelOnly and KSampler) with a
    # random rank-16 LoRA on every attention and feed-forward layer, at strength 1 and 0.
    "server: LoRA + KSampler, strength 1": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "lora": 1.0,
    },
    "server: LoRA + KSampler, strength 0": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "lora": 0.0,
    },
    # The same with the int8 Model Loader's keep_loaded on (node 2): the MODEL stays on the GPU between
    # prompts, as ComfyUI keeps its own; T5 and the VAE still unload as shipped.
    "server: LoRA + KSampler, strength 1, MODEL kept": {
        "kind": "server",
        "workflow": "pixart_lowvram_lora_ksampler_api.json",
        "lora": 1.0,
        "sets": ["2.keep_loaded=true"],
    },
    # ComfyUI core's own fp16 PixArt-Σ as its users build it, through the same server (its defaults:
    # Dynamic VRAM on NVIDIA), with the pack's Batched Guidance (PixArt-Σ) node before KSampler, and with
    # Dynamic VRAM off.
    "server: ComfyUI core fp16": {"kind": "server", "core": True},
    "server: ComfyUI core fp16 + Batched Guidance": {"kind": "server", "core": True, "patch": True},
    "server: ComfyUI core fp16, --disable-dynamic-vram": {
        "kind": "server",
        "core": True,
        "args": ("--disable-dynamic-vram",),
    },
}
ANCHOR = next(iter(CONFIGS))
WARM_UP = "warm-up: fill the pre-quantized cache"
SAMPLING_NODES = ("KSampler", "PixArtQ_Sampler")  # a server row's sampling node (websocket node seconds)
CONFIGS[WARM_UP] = {"kind": "pack", "prompts": 1}


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class Prompt:
    """Clock, peaks and copies of one prompt in this process."""

    def __enter__(self):
        from pixart_lowvram.core import streaming

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.copied = streaming.copied_to_device()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        from pixart_lowvram.core import streaming

        torch.cuda.synchronize()
        self.record = {
            "seconds": time.perf_counter() - self.start,
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "rss": rss(),
            "copied_to_gpu": streaming.copied_to_device() - self.copied,
        }


PROFILED = 2  # the prompt that --profile records (a later one)


@contextmanager
def profiled(out: str | None):
    """torch's profiler around one prompt, its tables (CPU and CUDA time) written to ``out``."""
    if out is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    averages = prof.key_averages()
    Path(out).write_text(
        averages.table(sort_by="cpu_time_total", row_limit=45)
        + "\n\n"
        + averages.table(sort_by="self_cuda_time_total", row_limit=30)
    )


def digest(tensor: torch.Tensor) -> str:
    import hashlib

    data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()[:16]


def cap(gib: float | None) -> None:
    if gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(gib * GIB / total)


def run_anchor(model_dir: Path) -> tuple[list[dict], list[torch.Tensor]]:
    from diffusers import PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline.from_pretrained(model_dir, dtype=torch.float16).to("cuda")
    records, images = [], []
    for text, seed in [*PROMPTS, REPEAT]:
        # The pipeline runs without autograd; its VAE's decode called here must too, or each prompt's
        # activations stay referenced from the image (11 GiB a prompt at 1024²).
        with Prompt() as p, torch.inference_mode():
            latents = pipe(
                text,
                width=SETTINGS["width"],
                height=SETTINGS["height"],
                num_inference_steps=SETTINGS["steps"],
                guidance_scale=SETTINGS["cfg"],
                generator=torch.Generator("cpu").manual_seed(seed),
                output_type="latent",
                return_dict=False,
            )[0]
            image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
            image = image.float().cpu()
        records.append(p.record | {"png_seconds": harness.png_seconds((image / 2 + 0.5).clamp(0, 1))})
        images.append(image)
    return records, images


def run_pack(model_dir: Path, config: dict, quant_cache: Path) -> tuple[list[dict], list[torch.Tensor]]:
    from pixart_lowvram.core import measure, models, sampler, text_encoder, vae
    from pixart_lowvram.core.pool import cache

    cap(config.get("cap_gib"))
    source = models.resolve_model(str(model_dir))
    low_vram, fast = config.get("low_vram", False), config.get("fast", False)
    records, images, outputs = [], [], []
    for index, (text, seed) in enumerate([*PROMPTS, REPEAT][: config.get("prompts")]):
        report = measure.MemoryReport()
        with Prompt() as p, profiled(config.get("profile") if index == PROFILED else None):
            encoding = text_encoder.EncoderSettings(
                source, device="cuda", low_vram=low_vram, quant_cache=quant_cache
            )
            embeds = text_encoder.encode(encoding, text, "", report=report)
            sampling = sampler.SamplerSettings(
                source,
                **SETTINGS,
                seed=seed,
                device="cuda",
                low_vram=low_vram,
                fast=fast,
                step_cache=config.get("step_cache", 0.0),
                compute=config.get("compute", "fp16"),
                quant_cache=quant_cache,
            )
            latents = sampler.sample(sampling, embeds, report=report)
            decoding = vae.DecoderSettings(source, device="cuda", tiling="on" if low_vram else "auto")
            image = vae.decode(decoding, latents, report=report)
        # Each stage resets the peak statistics when it starts: the prompt's peaks are its stages' highest.
        peaks = [(stage.peak_allocated, stage.peak_reserved) for stage in report.stages]
        records.append(
            p.record
            | {
                "peak_allocated": max(allocated for allocated, _ in peaks),
                "peak_reserved": max(reserved for _, reserved in peaks),
                "pool_bytes": cache.pool_bytes(),
                "allocated_after": torch.cuda.memory_allocated(),
                "stages": {s.stage: round(s.seconds, 3) for s in report.stages},
                "stage_peaks": {s.stage: (s.peak_allocated, s.peak_reserved) for s in report.stages},
                # which stage's output differs when the 6th image differs from the 1st
                "digests": {"embeds": digest(embeds.prompt_embeds), "latents": digest(latents)},
            }
        )
        images.append(image)
        outputs.append(latents)
    if config.get("keep_outputs"):
        torch.save({"latents": outputs, "images": images}, config["keep_outputs"])
    return records, images


def run_core(
    model_dir: Path, comfyui: Path, config: dict, tree: Path
) -> tuple[list[dict], list[torch.Tensor]]:
    import comfyui_path

    comfyui_path.write_models_tree(model_dir, tree)
    sys.path.insert(0, str(comfyui))
    comfyui_path.simulate_card(config["card_gb"])
    import folder_paths

    import nodes

    for folder in comfyui_path.FILES:
        folder_paths.add_model_folder_path(folder, str(tree / folder), is_default=True)
    files = comfyui_path.FILES
    # Loaded once, as a server's node cache keeps the loaders' outputs between prompts.
    clip = nodes.CLIPLoader().load_clip(files["text_encoders"], "pixart")[0]
    model = nodes.UNETLoader().load_unet(files["diffusion_models"], "default")[0]
    vae = nodes.VAELoader().load_vae(files["vae"])[0]
    records, images = [], []
    for text, seed in [*PROMPTS, REPEAT]:
        with Prompt() as p, torch.inference_mode():  # as ComfyUI's executor runs nodes
            encode = nodes.CLIPTextEncode()
            positive, negative = encode.encode(clip, text)[0], encode.encode(clip, "")[0]
            latent = nodes.EmptyLatentImage().generate(SETTINGS["width"], SETTINGS["height"], 1)[0]
            samples = nodes.KSampler().sample(
                model,
                seed,
                SETTINGS["steps"],
                SETTINGS["cfg"],
                "dpmpp_2m",
                "normal",
                positive,
                negative,
                latent,
            )[0]
            image = nodes.VAEDecode().decode(vae, samples)[0].float().cpu()
        records.append(p.record)
        images.append(image)
    return records, images


def core_workflow(patch: bool = False, cpu_check: bool = False) -> dict:
    """ComfyUI core's own PixArt-Σ graph (API format): CLIPLoader (T5-XXL fp16, type pixart), two
    CLIPTextEncode, UNETLoader, EmptyLatentImage, KSampler (dpmpp_2m, normal), VAELoader, VAEDecode,
    SaveImage, on the single files ``comfyui_path.write_models_tree`` writes; with ``patch`` the pack's
    Batched Guidance (PixArt-Σ) between UNETLoader and KSampler. ``cpu_check``: the conditioning from the
    pack's Quantized T5 Encode and the pack's VAE Decode instead (CLIPLoader builds T5-XXL at its full size,
    4.8 B parameters, and VAELoader the SDXL VAE's widths, whatever the files hold: too large for a CPU check
    or not the small model's)."""
    import comfyui_path

    files, size = comfyui_path.FILES, SETTINGS["width"]
    sampler = {"sampler_name": "dpmpp_2m", "scheduler": "normal", "denoise": 1.0, "seed": 0}
    sampler |= {"steps": SETTINGS["steps"], "cfg": SETTINGS["cfg"]}
    nodes = {
        "1": ("CLIPLoader", {"clip_name": files["text_encoders"], "type": "pixart"}),
        "2": ("CLIPTextEncode", {"clip": ["1", 0], "text": ""}),
        "3": ("CLIPTextEncode", {"clip": ["1", 0], "text": ""}),
        "4": ("UNETLoader", {"unet_name": files["diffusion_models"], "weight_dtype": "default"}),
        "5": ("EmptyLatentImage", {"width": size, "height": size, "batch_size": 1}),
        "6": (
            "KSampler",
            sampler
            | {"model": ["4", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["5", 0]},
        ),
        "7": ("VAELoader", {"vae_name": files["vae"]}),
        "8": ("VAEDecode", {"samples": ["6", 0], "vae": ["7", 0]}),
        "9": ("SaveImage", {"images": ["8", 0], "filename_prefix": "core"}),
    }
    if patch:
        nodes["10"] = ("PixArtQ_BatchedGuidance", {"model": ["4", 0]})
        nodes["6"][1]["model"] = ["10", 0]
    if cpu_check:
        del nodes["1"], nodes["3"]
        encode = {"model": "pixart-full", "prompt": "", "negative_prompt": "", "quantization": "nf4"}
        nodes["2"] = ("PixArtQ_T5Encode", encode | {"keep_loaded": False, "low_vram": False})
        nodes["6"][1].update(positive=["2", 1], negative=["2", 2])
        del nodes["7"]  # and the pack's decode: VAELoader builds the SDXL VAE's widths, not a small one's
        decode = {"model": "pixart-full", "latent": ["6", 0], "keep_loaded": False, "tiling": "auto"}
        nodes["8"] = ("PixArtQ_VAEDecode", decode | {"vae_file": "(from model)"})
    return {key: {"class_type": kind, "inputs": inputs} for key, (kind, inputs) in nodes.items()}


def sized_down(workflow: dict) -> dict:
    """``workflow`` at :data:`SETTINGS`' size and steps (the CPU check's): every width, height and steps
    input."""
    for node in workflow.values():
        for name in ("width", "height", "steps"):
            if name in node["inputs"] and not isinstance(node["inputs"][name], list):
                node["inputs"][name] = SETTINGS[name]
    return workflow


def link_core_models(model_dir: Path, base: Path, tree: Path) -> None:
    """The single files core's loaders read, written once into ``tree`` and linked into the server's
    models/ folders."""
    import comfyui_path

    comfyui_path.write_models_tree(model_dir, tree)
    for folder, name in comfyui_path.FILES.items():
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
        (base / "models" / folder / name).symlink_to(tree / folder / name)


def run_server(
    model_dir: Path, comfyui: Path, config: dict, base: Path, cpu_check: bool = False
) -> tuple[list[dict], list[torch.Tensor]]:
    """A workflow through a real server, its prompts one at a time (:func:`server_row`)."""
    with server_row(model_dir, comfyui, config, base, cpu_check) as prompt:
        done = [
            prompt(index, text, seed)
            for index, (text, seed) in rounds_by(config["rounds"], config.get("until"))
        ]
    return [record for record, _ in done], [image for _, image in done]


def run_together(
    names: list[str],
    model_dir: Path,
    comfyui: Path,
    rounds: int,
    work: Path,
    cpu_check: bool = False,
    until: float | None = None,
) -> dict[str, tuple[list[dict], list[torch.Tensor]]]:
    """Server rows interleaved (``--interleave``): every row's server started and kept up, then each prompt
    of the sequence on every server in turn, the order rotated by one each prompt, so that each row meets the
    same host periods (the host's speed drifts over minutes, more than the rows differ). The card is shared,
    so its used memory is not told apart per server: those rows' card used is left out."""
    done: dict[str, tuple[list[dict], list[torch.Tensor]]] = {name: ([], []) for name in names}
    with ExitStack() as stack:
        rows = {
            name: stack.enter_context(
                server_row(
                    model_dir,
                    comfyui,
                    CONFIGS[name],
                    Path(tempfile.mkdtemp(dir=work)),
                    cpu_check,
                    card_shared=True,
                )
            )
            for name in names
        }
        for index, (text, seed) in rounds_by(rounds, until):
            turn = index % len(names)
            for position, name in enumerate(names[turn:] + names[:turn]):
                record, image = rows[name](index, text, seed)
                done[name][0].append(record | {"turn": position})
                done[name][1].append(image)
    return done


@contextmanager
def server_row(
    model_dir: Path,
    comfyui: Path,
    config: dict,
    base: Path,
    cpu_check: bool = False,
    card_shared: bool = False,
):
    """A workflow through a real server: the bundled basic workflow unless the configuration names another,
    or core's own graph. Yields ``prompt(index, text, seed)``, which runs one prompt (submit to images
    downloaded) and gives its record and image: the RSS of the server's whole process tree after it and the
    card's used memory during it (not where ``card_shared``: other servers on the card)."""
    import comfy_server
    import numpy as np
    from PIL import Image

    from pixart_lowvram.cli import client as api

    if config.get("core"):
        workflow, sets = core_workflow(config.get("patch", False), cpu_check), []
        link_core_models(model_dir, base, base.parent / "core_models")
    else:
        name = config.get("workflow", "pixart_lowvram_basic_api.json")
        workflow = api.load_workflow(comfy_server.REPO / "workflows" / "api" / name)
        workflow = harness.without(workflow, config.get("drop", ()))
        sets = [
            f"{key}.model=pixart-full"
            for key, node in workflow.items()
            if isinstance(node["inputs"].get("model"), str)
        ]
        sets += [
            f"{key}.keep_loaded={bool(config.get('keep'))}"
            for key, node in workflow.items()
            if "keep_loaded" in node["inputs"]
        ]
        sets += config.get("sets", [])
        if config.get("no_snapshot"):
            workflow = harness.without(workflow, ("PixArtQ_MemorySnapshot",))
        if "lora" in config:  # a random rank-16 LoRA on every attention and feed-forward layer
            from pixart_lowvram.cli.random_model import save_random_lora

            save_random_lora(model_dir, base / "models" / "loras" / LORA_FILE, rank=16, scale=0.02)
            for node in workflow.values():
                if node["class_type"] == "LoraLoaderModelOnly":
                    node["inputs"] |= {"lora_name": LORA_FILE, "strength_model": config["lora"]}
    if cpu_check:
        workflow = sized_down(workflow)
    with comfy_server.started(
        comfyui,
        base,
        {"pixart-full": model_dir},
        sys.executable,
        cpu=cpu_check,
        extra_args=tuple(config.get("args", ())),
        env=config.get("env"),
    ) as server:
        client = api.Client(server.url)
        # The client's check against /object_info, once: a front end does not repeat it per prompt.
        client.check(api.apply_overrides(workflow, sets))
        ws = client.connect()
        card_measured = not (cpu_check or card_shared)

        def run_prompt(index: int, text: str, seed: int) -> tuple[dict, torch.Tensor]:
            # Core's graph has no T5 Encode node: its text goes into its positive CLIPTextEncode.
            prompt = api.apply_overrides(
                workflow, sets, prompt=None if config.get("core") else text, seed=seed
            )
            if config.get("core"):
                prompt["2"]["inputs"]["text" if "text" in prompt["2"]["inputs"] else "prompt"] = text
            log_start = server.log.stat().st_size
            starts: list[tuple[str | None, float]] = []  # (node, when ComfyUI said it started)

            def seen(kind: str, data: dict, starts=starts) -> None:
                if kind == "executing":
                    starts.append((data.get("node"), time.perf_counter()))

            host_before = comfy_server.cpu_ticks(server.pid)
            start = time.perf_counter()
            with harness.CardUsed(enabled=card_measured) as used:
                outcome = client.run(ws, prompt, base / f"images-{index}", 600, None, seen)
            record = {"seconds": time.perf_counter() - start, "rss": comfy_server.tree_rss(server.pid)}
            record["host"] = comfy_server.host_share(host_before, comfy_server.cpu_ticks(server.pid))
            record["device_used"] = used.peak if card_measured else None
            record |= node_seconds(starts, start, prompt)
            with server.log.open("rb") as log:
                log.seek(log_start)
                record |= server_stages(log.read().decode("utf-8", "replace"))
            with Image.open(outcome.files[0]) as image:
                return record, torch.from_numpy(np.asarray(image).copy())

        try:
            yield run_prompt
        finally:
            if ws is not None:
                ws.close()


def node_seconds(starts: list[tuple[str | None, float]], submitted: float, prompt: dict) -> dict:
    """Where a server prompt's time went, from the websocket's ``executing`` messages (each node's start,
    then one with no node once the history is written): seconds from submit to the first node, each node
    class's seconds, and SaveImage's apart."""
    if not starts or starts[-1][0] is not None:
        return {}
    nodes: dict[str, float] = {}
    for (node, began), (_next, ended) in itertools.pairwise(starts):
        name = prompt[node]["class_type"]
        nodes[name] = nodes.get(name, 0.0) + ended - began
    return {
        "until_first_node": starts[0][1] - submitted,
        "node_seconds": nodes,
        "save_seconds": nodes.get("SaveImage"),
    }


# The pack's log line for each stage (core.measure.stage): name | device | peak allocated | reserved | seconds
STAGE_LINE = re.compile(r"stage (\w+) \| [^|]+ \| ([\d.]+) (GiB|MiB) \| ([\d.]+) (GiB|MiB) \| ([\d.]+)")
UNITS = {"GiB": 2**30, "MiB": 2**20}
# ComfyUI's own line at a prompt's end: the executor's time, without the HTTP round trip and the download.
EXECUTED = re.compile(r"Prompt executed in ([\d.]+) seconds")


def server_stages(log: str) -> dict:
    """One prompt's stages from the server log: seconds and GPU peaks each, the prompt's peaks, and how many
    models came back from host memory or were reused kept."""
    stages = [
        (m[1], float(m[2]) * UNITS[m[3]], float(m[4]) * UNITS[m[5]], float(m[6]))
        for m in STAGE_LINE.finditer(log)
    ]
    if not stages:
        return {}
    executed = EXECUTED.search(log)
    return {
        "executed_seconds": float(executed[1]) if executed else None,
        "peak_allocated": int(max(allocated for _, allocated, _, _ in stages)),
        "peak_reserved": int(max(reserved for _, _, reserved, _ in stages)),
        "stages": {name: seconds for name, _, _, seconds in stages},
        "stage_peaks": {name: (int(allocated), int(reserved)) for name, allocated, reserved, _ in stages},
        "from_host_memory": log.count("from host memory ("),
        "reused_kept": log.count("reusing kept model"),
    }


def one(name: str, args) -> None:
    """One configuration in this (fresh) process; its row to ``args.one_out``."""
    config = CONFIGS[name]
    kind = config["kind"]
    work = Path(args.work)
    if args.profile and kind == "pack":
        config = config | {"profile": str(harness.traces("warm") / f"{slug(name)}.txt")}
    if kind == "server":
        config = config | {"rounds": args.rounds, "until": args.until_time}
    if kind == "anchor":
        records, images = run_anchor(args.model_dir)
    elif kind == "pack":
        # Every pack row's latents and images, for the lossy rows' fidelity against their reference.
        config = config | {"keep_outputs": str(work / f"{slug(name)}.outputs.pt")}
        records, images = run_pack(args.model_dir, config, work / "quant_cache")
    elif kind == "core":
        records, images = run_core(args.model_dir, args.comfyui, config, work / "core_models")
    else:
        # The server's pack reads the pre-quantized cache the warm-up filled.
        os.environ["PIXART_LOWVRAM_QUANT_CACHE"] = str(work / "quant_cache")
        records, images = run_server(
            args.model_dir, args.comfyui, config, Path(tempfile.mkdtemp(dir=work)), args.cpu_check
        )
    Path(args.one_out).write_text(json.dumps(result_of(name, records, images)))


def together(names: list[str], args) -> None:
    """Server rows interleaved in this (fresh) process (:func:`run_together`); their rows to
    ``args.one_out``, by name."""
    work = Path(args.work)
    os.environ["PIXART_LOWVRAM_QUANT_CACHE"] = str(work / "quant_cache")
    done = run_together(
        names, args.model_dir, args.comfyui, args.rounds, work, args.cpu_check, args.until_time
    )
    results = {
        name: result_of(name, records, images) | {"interleaved": names}
        for name, (records, images) in done.items()
    }
    Path(args.one_out).write_text(json.dumps(results))


def result_of(name: str, records: list[dict], images: list[torch.Tensor]) -> dict:
    """A row: its configuration, its records, and whether the repeat's image (and each later round's)
    equals its first; ``rounds``: the rounds it ran."""
    result = {
        # The configuration as declared (the workflow, its --set overrides, the LoRA's strength …), beside
        # its figures.
        "arguments": CONFIGS[name],
        "records": records,
        "repeat_identical": bool(torch.equal(images[0], images[min(REPEAT_INDEX, len(images) - 1)])),
    }
    if len(images) > REPEAT_INDEX + 1:  # rounds: each later round's prompt against the first round's
        result["rounds"] = 1 + (len(images) - REPEAT_INDEX - 1) // ROUND
        result["rounds_identical"] = all(
            torch.equal(image, images[1 + index % ROUND])
            for index, image in enumerate(images[REPEAT_INDEX + 1 :])
        )
    return result


def fidelity(ours: Path, reference: Path) -> dict:
    """Prompt by prompt, a lossy row's latents and images against its reference row's (the same prompts and
    seeds): the latents' cosine similarity and the 8-bit image's PSNR in dB (inf where equal)."""
    import math

    a, b = torch.load(ours, weights_only=True), torch.load(reference, weights_only=True)
    cosines = [
        float(torch.nn.functional.cosine_similarity(x.flatten().double(), y.flatten().double(), dim=0))
        for x, y in zip(a["latents"], b["latents"], strict=True)
    ]
    psnrs = []
    for x, y in zip(a["images"], b["images"], strict=True):
        mse = float(((x * 255).round().double() - (y * 255).round().double()).pow(2).mean())
        psnrs.append(math.inf if mse == 0 else 10 * math.log10(255**2 / mse))
    return {"latent_cosine": cosines, "image_psnr_db": psnrs}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")[:60]


def summary(records: list[dict], anchor: float | None) -> dict:
    later = later_records(records)
    mean_later = sum(r["seconds"] for r in later) / len(later)
    out = {
        "first_seconds": records[0]["seconds"],
        "later_seconds": mean_later,
        "later_median_seconds": statistics.median(r["seconds"] for r in later),
        "later_ratio": None if not anchor else mean_later / anchor,
    }
    # Through a server: the sampling node's own seconds (KSampler or the Quanto PixArt Sampler), steadier
    # than the whole prompt's.
    sampling = [
        next((r["node_seconds"][n] for n in SAMPLING_NODES if n in r.get("node_seconds", {})), None)
        for r in later
    ]
    if sampling and None not in sampling:
        out["later_sampling_node_seconds"] = sum(sampling) / len(sampling)
        out["later_sampling_node_median_seconds"] = statistics.median(sampling)
    hosts = [r["host"] for r in later if r.get("host")]
    if len(hosts) == len(later):
        for key in ("steal", "busy", "server_cpu_seconds"):
            out[f"later_host_{key}"] = sum(h[key] for h in hosts) / len(hosts)
    # The pack's stages alone (their sum), through a server ComfyUI's executor time, and the anchor's PNG.
    for key, values in (
        ("stages", [sum(r["stages"].values()) for r in later if r.get("stages")]),
        ("executed", [r["executed_seconds"] for r in later if r.get("executed_seconds")]),
        ("png", [r["png_seconds"] for r in later if r.get("png_seconds")]),
        ("save", [r["save_seconds"] for r in later if r.get("save_seconds")]),
        ("unsaved", [r["seconds"] - r["save_seconds"] for r in later if r.get("save_seconds")]),
    ):
        if len(values) == len(later):
            mean = sum(values) / len(values)
            out[f"later_{key}_seconds"] = mean
            out[f"later_{key}_ratio"] = None if not anchor else mean / anchor
    for key in ("peak_allocated", "peak_reserved", "copied_to_gpu", "pool_bytes", "rss", "device_used"):
        values = [r[key] for r in later if r.get(key) is not None]
        if values:
            out[f"later_max_{key}"] = max(values)
    return out


def seconds_and_ratio(summary: dict, key: str) -> str:
    seconds, ratio = summary.get(f"later_{key}_seconds"), summary.get(f"later_{key}_ratio")
    if seconds is None:
        return "–"
    return f"{seconds:.2f}" + ("" if ratio is None else f" ({ratio:.2f})")


def ordered(rows: dict) -> list[tuple[str, dict]]:
    """The rows in the order of :data:`CONFIGS`, any others after."""
    known = [name for name in CONFIGS if name in rows]
    return [(name, rows[name]) for name in known + [n for n in rows if n not in CONFIGS]]


def markdown(result: dict) -> str:
    """The tables of a result: every row (its run, figures, ratios to its own run's anchor), the runs'
    anchors, the lossy rows' fidelity, each prompt's seconds, the server rows' medians and the interleaved
    rows' comparisons."""
    rows = dict(ordered(result["rows"]))
    run = {name: harness.run_of(result, row) for name, row in rows.items()}
    repeated = sorted({(run[n], r["rounds"]) for n, r in rows.items() if r.get("rounds", 1) > 1})
    lines = [
        f"{SETTINGS['cfg']:g} cfg, batch 1, the full-size architecture with random weights (size and steps: "
        "each run's command, 1024² and 20 steps where it names none); five prompts with their own text and "
        "seed, then the first again"
        + "".join(f"; run {n}'s server rows then prompts 2–5 again, {k} rounds in all" for n, k in repeated)
        + ". Later s: the mean of the later prompts (2–5, and every further round's), the prompt's wall clock "
        "(through a server: submit to image downloaded); × anchor: over the later seconds of the anchor of "
        "the row's own run; stages s: the pack's three stages alone; ComfyUI executed s: ComfyUI's own time "
        "for the prompt (its log), SaveImage's PNG included; PNG s: the anchor's image written as SaveImage "
        "writes it (not in its seconds), and through a server SaveImage's own seconds (its start to the next "
        "node's, from the websocket); later − PNG: a server prompt without them.",
        "",
    ]
    table = []
    for name, row in rows.items():
        s = row["summary"]
        png = s.get("later_png_seconds", s.get("later_save_seconds"))
        same = row["repeat_identical"] and row.get("rounds_identical", True)
        table.append(
            [
                name,
                run[name],
                f"{s['first_seconds']:.2f}",
                f"{s['later_seconds']:.2f}",
                "–" if s["later_ratio"] is None else f"{s['later_ratio']:.2f}",
                seconds_and_ratio(s, "stages"),
                seconds_and_ratio(s, "executed"),
                "–" if png is None else f"{png:.3f}",
                seconds_and_ratio(s, "unsaved"),
                f"{harness.gib(s.get('later_max_peak_allocated'))} / "
                f"{harness.gib(s.get('later_max_peak_reserved'))}",
                harness.gib(s.get("later_max_copied_to_gpu")),
                harness.gib(s.get("later_max_pool_bytes")),
                harness.gib(s.get("later_max_rss")),
                harness.gib(s.get("later_max_device_used")),
                "yes" if same else "**no**",
            ]
        )
    lines += harness.table(
        [
            "configuration",
            "run",
            "1st prompt s",
            "later s",
            "× anchor",
            "stages s (×)",
            "ComfyUI executed s (×)",
            "PNG s",
            "later − PNG s (×)",
            "GPU peak alloc / reserved GiB (later)",
            "host→GPU GiB per later prompt",
            "pool GiB",
            "host RSS GiB",
            "card used GiB (later, server rows)",
            "6th = 1st (each round = its first)",
        ],
        table,
    )
    anchors = {}
    for name, row in rows.items():
        anchor = row.get("anchor") or {}
        if anchor.get("later_seconds") and run[name] not in anchors:
            anchors[run[name]] = anchor
    if anchors:
        lines += [
            "",
            "The anchor of each run: its later seconds, and with its image written as SaveImage writes it:",
            "",
        ]
        for number, anchor in sorted(anchors.items(), key=lambda item: int(item[0])):
            line = f"- run {number}: {anchor['later_seconds']:.2f} s"
            png = anchor.get("png_seconds")
            if png is not None:
                both = anchor["later_seconds"] + png
                servers = [
                    f"{name} {row['summary']['later_seconds'] / both:.2f}×"
                    for name, row in rows.items()
                    if run[name] == number and row.get("summary", {}).get("later_save_seconds") is not None
                ]
                line += f"; {both:.2f} s with its PNG" + (
                    f" (the run's server rows over that: {', '.join(servers)})" if servers else ""
                )
            lines.append(line)
    lossy = {name: r for name, r in rows.items() if "fidelity" in r and "summary" in r}
    if lossy:
        lines += [
            "",
            "Lossy rows against their reference of the same run (the same prompts and seeds), prompts 1–5: the "
            "latents' cosine similarity and the image's PSNR (8-bit), worst and mean; later s × the "
            "reference's later s.",
            "",
        ]
        lossy_rows = []
        for name, row in lossy.items():
            cos = row["fidelity"]["latent_cosine"][: len(PROMPTS)]
            psnr = row["fidelity"]["image_psnr_db"][: len(PROMPTS)]
            later, base = row["summary"]["later_seconds"], row["fidelity"].get("reference_later_seconds")
            lossy_rows.append(
                [
                    name,
                    run[name],
                    row["fidelity"]["reference"],
                    f"{later:.2f}" + ("" if not base else f" ({later / base:.2f})"),
                    f"{min(cos):.5f} / {sum(cos) / len(cos):.5f}",
                    f"{min(psnr):.1f} / {sum(psnr) / len(psnr):.1f}",
                ]
            )
        lines += harness.table(
            [
                "configuration",
                "run",
                "reference",
                "later s (× reference)",
                "latent cosine min / mean",
                "image PSNR dB min / mean",
            ],
            lossy_rows,
        )
    shipped = rows.get("server: pack defaults")
    bare = rows.get("server: pack defaults, no Memory Snapshot")
    if shipped and "records" in shipped:
        later = shipped["records"][1 : len(PROMPTS)]
        own = [r.get("node_seconds", {}).get("PixArtQ_MemorySnapshot") for r in later]
        if all(value is not None for value in own):
            line = (
                f"The Memory Snapshot node as shipped (reporting only), its own time (its start to the next "
                f"node's): {sum(own) / len(own):.3f} s a later prompt (max {max(own):.3f} s)"
            )
            if bare and "summary" in bare and bare.get("run") == shipped.get("run"):
                difference = shipped["summary"]["later_seconds"] - bare["summary"]["later_seconds"]
                line += (
                    f"; the rows with and without it differ by {difference:+.3f} s, prompt-to-prompt noise"
                )
            lines += ["", line + "."]
    lines += ["", "Per prompt (seconds):", ""]
    for name, row in rows.items():
        if "records" in row:
            lines.append(f"- {name}: " + ", ".join(f"{r['seconds']:.2f}" for r in row["records"]))
    sampled = {
        n: r["summary"] for n, r in rows.items() if "later_sampling_node_seconds" in r.get("summary", {})
    }
    if sampled:
        lines += [
            "",
            "Server rows, the later prompts: the prompt's median, and the sampling node's own seconds (KSampler or "
            "the Quanto PixArt Sampler, its start to the next node's) as mean and median; the host during "
            "them (/proc/stat: the CPUs' time stolen by the hypervisor and busy, the server's own CPU "
            "seconds):",
            "",
        ]
        lines += [
            f"- {name}: prompt median {s['later_median_seconds']:.2f} s; sampling node "
            f"{s['later_sampling_node_seconds']:.3f} s mean, {s['later_sampling_node_median_seconds']:.3f} s median"
            + (
                f"; host: steal {100 * s['later_host_steal']:.1f} %, busy {100 * s['later_host_busy']:.1f} %, "
                f"the server's CPU {s['later_host_server_cpu_seconds']:.2f} s a prompt"
                if "later_host_steal" in s
                else ""
            )
            for name, s in sampled.items()
        ]
    groups = {tuple(r["interleaved"]) for r in rows.values() if "interleaved" in r}
    for together in sorted(groups):
        if not all(rows.get(name, {}).get("interleaved") == list(together) for name in together):
            continue  # some of the group measured again since, one by one
        lines += [
            "",
            f"Server rows interleaved: {len(together)} servers up at once, each prompt on each in turn (the order "
            "rotated by one each prompt), so every row met the same host periods; the card is shared, so "
            f"its used memory is not told apart per server (the rows one by one give it). Each row against "
            f"{together[0]} (and the patched core against core's own), prompt by prompt (the same prompt's "
            "seconds over its; later prompts): the ratio of the means, and the median and range of the "
            "per-prompt ratios:",
            "",
        ]
        guided = " + Batched Guidance"  # the patched core row also against core's own
        against = [(name, together[0]) for name in together[1:]]
        against += [
            (n, n.removesuffix(guided))
            for n in together
            if n.endswith(guided) and n.removesuffix(guided) in together
        ]
        for name, other in against:
            pairs = [
                (r["seconds"], b["seconds"])
                for r, b in zip(
                    later_records(rows[name]["records"]),
                    later_records(rows[other]["records"]),
                    strict=True,
                )
            ]
            ratios = [r / b for r, b in pairs]
            lines.append(
                f"- {name} against {other}: {sum(r for r, _ in pairs) / sum(b for _, b in pairs):.3f}× (median "
                f"{statistics.median(ratios):.3f}×, {min(ratios):.2f}–{max(ratios):.2f}×)"
            )
    return "\n".join(lines) + "\n"


def finish(names: list[str], results: dict, work: Path) -> dict:
    """This run's rows as the result keeps them: each with its summary against this run's anchor, the
    anchor's figures, and a lossy row's fidelity against its reference."""
    anchor = results.get(ANCHOR, {}).get("records")
    anchor_later = (
        None if not anchor else sum(r["seconds"] for r in anchor[1 : len(PROMPTS)]) / (len(PROMPTS) - 1)
    )
    anchor_png = None
    if anchor and all(r.get("png_seconds") is not None for r in anchor[1 : len(PROMPTS)]):
        anchor_png = sum(r["png_seconds"] for r in anchor[1 : len(PROMPTS)]) / (len(PROMPTS) - 1)
    rows = {}
    for name in names:
        if "records" not in results.get(name, {}) or name == WARM_UP:
            continue  # a row that failed keeps its last measurement
        row = results[name]
        reference = CONFIGS[name].get("fidelity_vs")
        if (
            reference
            and "records" in row
            and "records" in results.get(reference, {})
            and "fidelity" not in row
        ):
            row["fidelity"] = fidelity(
                work / f"{slug(name)}.outputs.pt", work / f"{slug(reference)}.outputs.pt"
            )
            row["fidelity"] |= {
                "reference": reference,
                "reference_later_seconds": summary(results[reference]["records"], None)["later_seconds"],
            }
        row["summary"] = summary(row["records"], anchor_later)
        row["anchor"] = {"later_seconds": anchor_later, "png_seconds": anchor_png}
        rows[name] = row
    return rows


class SelfCheckFailed(AssertionError):
    """A self-check found the prompt sequence, the rounds or a comparison not as they must be."""


class Clock:
    """A fake ``time.time`` that the self-check moves on by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def self_check() -> list[str]:
    """The server rows' prompt sequence, the rounds, a time limit that keeps whole rounds, each round's
    image checked against its first, and interleaved rows compared prompt by prompt: the names of the
    checks, each raising :class:`SelfCheckFailed` where it fails."""

    def expect(condition: bool, what: str) -> None:
        if not condition:
            raise SelfCheckFailed(what)

    def images(count: int) -> list[torch.Tensor]:
        """Images as a deterministic server gives them: the same prompt the same image."""
        return [torch.full((2, 2, 3), float(sequence(3).index(p))) for p in sequence(3)[:count]]

    clock, real_time = Clock(), time.time
    done = []
    time.time = clock
    try:
        expect(list(rounds_by(3)) == list(enumerate(sequence(3))), "rounds_by(3) is not the sequence")
        expect(len(sequence(3)) == 6 + 4 + 4, "three rounds are not 6 + 4 + 4 prompts")
        done.append("without a limit every round runs")

        until = clock.now + 11  # at a second a prompt: the six, one round of four (ends at 10), not the next
        ran = []
        for index, item in rounds_by(5, until):
            ran.append((index, item))
            clock.now += 1.0
        expect(ran == list(enumerate(sequence(2))), f"a limit kept {len(ran)} prompts, not two whole rounds")
        done.append("a limit keeps whole rounds")

        ran = []
        for index, _item in rounds_by(3, clock.now - 1):
            ran.append(index)
            clock.now += 1.0
        expect(ran == list(range(6)), f"a limit already past ran {ran}, not the first round")
        done.append("the first round runs whatever the limit")
    finally:
        time.time = real_time

    same = result_of("server: pack defaults", [{}] * 14, images(14))
    expect(same["repeat_identical"] and same["rounds_identical"] and same["rounds"] == 3, f"{same}")
    cut = result_of("server: pack defaults", [{}] * 10, images(10))
    expect(cut["rounds"] == 2 and cut["rounds_identical"], f"{cut}")
    changed = images(14)
    changed[12] = changed[12] + 1  # prompt 4 of the third round differs from its first
    expect(
        not result_of("server: pack defaults", [{}] * 14, changed)["rounds_identical"],
        "a changed image in the third round went unseen",
    )
    single = result_of(WARM_UP, [{}], images(1))
    expect(single["repeat_identical"] and "rounds" not in single, f"{single}")
    done.append("each round is checked against its first")

    names = [
        "server: pack defaults",
        "server: ComfyUI core fp16 + Batched Guidance",
        "server: ComfyUI core fp16",
    ]
    seconds = {names[0]: 1.0, names[1]: 1.5, names[2]: 2.0}
    rows = {}
    for name in names:
        records = [{"seconds": seconds[name] * (3 if i == 0 else 1)} for i in range(10)]
        rows[name] = result_of(name, records, images(10)) | {"interleaved": names, "run": 0}
        rows[name]["summary"] = summary(records, None)
    text = markdown({"rows": rows, "runs": [{"stamp": {}, "arguments": {}}]})
    for line in (
        "Server rows interleaved: 3 servers up at once",
        f"- {names[1]} against {names[0]}: 1.500× (median 1.500×, 1.50–1.50×)",
        f"- {names[2]} against {names[0]}: 2.000×",
        f"- {names[1]} against {names[2]}: 0.750×",
        "run 1's server rows then prompts 2–5 again, 2 rounds in all",
    ):
        expect(line in text, f"the table lacks {line!r}")
    done.append("interleaved rows are compared prompt by prompt")
    return done


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "warm", comfyui=True, size=harness.SIZE, steps=harness.STEPS, only=True)
    p.add_argument(
        "--profile",
        action="store_true",
        help="torch profiler tables of prompt 3 of each one-process row, in benchmarks/traces/warm/",
    )
    p.add_argument(
        "--cpu-check",
        action="store_true",
        help="the server rows (--only) on a CPU server, 272², 2 steps: that they run, not their numbers",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="server rows: after the six prompts, prompts 2-5 again this many times less one; later = all "
        "of them but the first and the repeat",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="server rows: all their servers up at once, each prompt on each in turn (the same host periods "
        "for every row); the card's used memory is then not told apart per server",
    )
    p.add_argument(
        "--until",
        type=float,
        default=None,
        help="seconds: server rows run a further round only where, at their pace, it ends within this many "
        "seconds of this command's start (a run under a time limit keeps whole rounds)",
    )
    p.add_argument("--self-check", action="store_true", help="check the rounds and comparisons, and stop")
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--one-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--together", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--until-time", type=float, default=None, help=argparse.SUPPRESS)
    args = harness.parse(p, argv, title=TITLE, render=markdown)
    if args.self_check:
        for name in self_check():
            print(f"ok: {name}")
        return 0
    if args.model_dir is None:
        p.error("give --model-dir")
    if args.until is not None and args.until_time is None:
        args.until_time = time.time() + args.until
    args.model_dir = args.model_dir.resolve()
    if args.cpu_check:
        args.size, args.steps = CPU_CHECK["size"], CPU_CHECK["steps"]
        names = [args.one] if args.one else args.together or args.only
        if not names or any(CONFIGS[name]["kind"] != "server" for name in names):
            p.error("--cpu-check takes server rows only, named with --only")
    SETTINGS.update(width=args.size, height=args.size, steps=args.steps)
    if args.one:
        one(args.one, args)
        return 0
    if args.together:
        together(args.together, args)
        return 0
    names = args.only or [
        name for name, c in CONFIGS.items() if c["kind"] not in ("core", "server") or args.comfyui
    ]
    if ANCHOR not in names and not args.cpu_check:
        names.insert(0, ANCHOR)
    work = Path(tempfile.mkdtemp(prefix="warm-"))
    results: dict = {}
    result = None
    run = harness.run(p, args, args.comfyui)
    # The pre-quantized cache is filled first, so every pack row's first prompt reads it warm.
    if any(CONFIGS[name]["kind"] in ("pack", "server") for name in names) and not args.cpu_check:
        names = [WARM_UP, *names]
    # Each row in a fresh process; with --interleave the server rows all in one, where the first was.
    servers = [name for name in names if CONFIGS[name]["kind"] == "server"] if args.interleave else []
    jobs = [[name] for name in names if name not in servers]
    if servers:
        first = next(i for i, name in enumerate(names) if name in servers)
        jobs.insert(sum(1 for name in names[:first] if name not in servers), servers)
    for job in jobs:
        name = " + ".join(job)
        one_out = work / "one.json"
        command = [sys.executable, __file__, "--model-dir", str(args.model_dir), "--work", str(work)]
        command += ["--one", job[0]] if job is not servers else [a for n in job for a in ("--together", n)]
        command += ["--one-out", str(one_out), "--size", str(args.size), "--steps", str(args.steps)]
        command += ["--rounds", str(args.rounds)]
        if args.profile:
            command += ["--profile"]
        if args.comfyui:
            command += ["--comfyui", str(args.comfyui)]
        if args.cpu_check:
            command += ["--cpu-check"]
        if args.until_time is not None:
            command += ["--until-time", repr(args.until_time)]
        started = time.perf_counter()
        # A row's environment: its process's, or for a server row its server's (server_row).
        env = os.environ | {
            k: v for n in job if CONFIGS[n]["kind"] != "server" for k, v in CONFIGS[n].get("env", {}).items()
        }
        proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0 or not one_out.is_file():
            lines = (proc.stderr or proc.stdout or "no output").strip().splitlines()
            print(f"{name}: FAILED ({lines[-1] if lines else f'exit {proc.returncode}'})", file=sys.stderr)
            print(proc.stderr[-3000:], file=sys.stderr)
            continue
        if job is servers:
            results |= json.loads(one_out.read_text())
        elif name != WARM_UP:
            results[name] = json.loads(one_out.read_text())
        one_out.unlink()
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        # after each: a run cut short keeps what it measured
        rows = finish(names, results, work)
        result = harness.write(args, {"rows": rows}, run=run, title=TITLE, render=markdown, merge="rows")
    if result is None:
        print("warm: no row was measured", file=sys.stderr)
        return 1
    print(harness.markdown_text(TITLE, result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
