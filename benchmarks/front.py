"""The front page's figures in one run: the bundled workflows through ComfyUI servers, ComfyUI core's own
fp16 PixArt-Σ through the same server, and the anchor, diffusers' fp16 pipeline kept on the GPU with its
image written as SaveImage writes it; on the card as it is and on the card limited to 8 and 4 GB.

Each group of :data:`GROUPS` runs together: the anchor in this process, every row's server started (a
fresh ComfyUI with its defaults, the pack linked in) and given one untimed prompt, then rounds. A round
gives every row, the anchor included, one prompt in turn (the order rotated each round), the same text and
seed for all, a text and seed no process has seen before. Each prompt is timed from submit to its image
downloaded; the card's memory is watched per process (NVML) during it. A row whose server does not start,
or whose prompt fails (out of memory), is recorded with its error and run no more.

A small card is made, not hinted: the server starts through benchmarks/card_limit.py, which caps torch's
allocator at the card's size and answers ComfyUI's questions about the card with it, and Dynamic VRAM is
told to leave the rest of the real card free (``--vram-headroom``, from the card's free memory at that
server's start). Each row's peak memory is its process's, and a peak over the card is shown as such.

The bundled workflows run as shipped: only their text, seed and (for ``--cpu-check``) size and steps are
set; the model folder is linked in as the name they use, and the LoRA workflow's LoRA file is a random
rank-16 LoRA on every attention and feed-forward layer. ComfyUI core's graph: CLIPLoader (T5-XXL fp16, type
pixart), CLIPTextEncode ×2, UNETLoader, EmptyLatentImage, KSampler (dpmpp_2m, normal), VAELoader,
VAEDecode, SaveImage, on single files of the same weights.

    python benchmarks/front.py --model-dir pixart-full --comfyui ComfyUI [--group NAME] [--rounds N]

One call may run one group (``--group``), in the time limit of a machine lent for minutes, the calls of one
run sharing ``--work`` (the group *started again* needs the card and LoRA groups' runs before it);
``--logs`` keeps each server's log; ``--combine`` joins the groups' results into one, refusing results of
other trees or GPUs. ``--render`` writes front.md again and the generated tables in README.md and
docs/BENCHMARKS.md; ``--check`` says whether they are as front.json makes them. ``--cpu-check``: every row
on CPU servers with a small model (272², 2 steps; build it with ``build_random_pixart(DIR, "tiny-core")``):
that the command runs, not its numbers.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import harness

NAME, TITLE = "front", "The front page's figures"
BASIC, LOW_VRAM, LORA = (f"pixart_lowvram_{n}_api.json" for n in ("basic", "low_vram", "lora_ksampler"))
MODEL_NAME = "PixArt-Sigma-XL-2-1024-MS"  # the bundled workflows' model
LORA_FILE = "pixart_sigma_lora.safetensors"  # the LoRA workflow's
ANCHOR = "anchor: diffusers fp16, all on the GPU, with its PNG"
CORE = "ComfyUI core fp16, its defaults"
SHIPPED = "basic workflow, as shipped"
# name: how the row runs. workflow: a bundled API workflow; sets: `queue --set` assignments; drop: node
# types taken out; core: ComfyUI core's own graph; card_gb: the card limited to this size; again: its
# server starts after the groups before have run its workflow on this machine (--work's caches written);
# env: the server's environment variables.
GRAPH_ON = {"PIXART_LOWVRAM_CUDA_GRAPH": "1"}
ROWS: dict[str, dict] = {
    ANCHOR: {"anchor": True},
    SHIPPED: {"workflow": BASIC},
    "basic workflow, compute fp16": {"workflow": BASIC, "sets": ["2.compute=fp16"]},
    "low-VRAM workflow, as shipped": {"workflow": LOW_VRAM},
    CORE: {"core": True},
}
GROUPS = {"card": list(ROWS)}
# Groups of four servers at most: more at once slowed every row of a group (core's KSampler 2.44 s against
# 1.45 s with six servers on an H100).
OTHERS = {
    "LoRA": {
        f"{ANCHOR}, beside the LoRA rows": {"anchor": True},
        "LoRA + KSampler workflow (int8 MODEL, rank-16 LoRA), as shipped": {"workflow": LORA},
        "LoRA + KSampler workflow without its LoRA (int8 MODEL)": {
            "workflow": LORA,
            "drop": ["LoraLoaderModelOnly"],
        },
        "LoRA + KSampler workflow (int8 MODEL, rank-16 LoRA), compute fp16": {
            "workflow": LORA,
            "sets": ["2.compute=fp16"],
        },
    },
    # The opt-in CUDA graph (core/step_graph.py) on both doors, beside each as shipped.
    "CUDA graph": {
        f"{ANCHOR}, beside the CUDA graph rows": {"anchor": True},
        f"{SHIPPED}, beside the CUDA graph rows": {"workflow": BASIC},
        "basic workflow, one CUDA graph a step": {"workflow": BASIC, "env": GRAPH_ON},
        "LoRA + KSampler workflow (int8 MODEL, rank-16 LoRA), as shipped, beside the CUDA graph rows": {
            "workflow": LORA
        },
        "LoRA + KSampler workflow (int8 MODEL, rank-16 LoRA), one CUDA graph a step": {
            "workflow": LORA,
            "env": GRAPH_ON,
        },
    },
    # The first prompt once the machine has run the workflow: its weights quantized, its blocks compiled.
    "started again": {
        f"{ANCHOR}, beside the restarted servers": {"anchor": True},
        f"{SHIPPED}, started again": {"workflow": BASIC, "again": True},
        "basic workflow, compute fp16, started again": {
            "workflow": BASIC,
            "sets": ["2.compute=fp16"],
            "again": True,
        },
        "LoRA + KSampler workflow (int8 MODEL, rank-16 LoRA), as shipped, started again": {
            "workflow": LORA,
            "again": True,
        },
        "LoRA + KSampler workflow (int8 MODEL, rank-16 LoRA), compute fp16, started again": {
            "workflow": LORA,
            "sets": ["2.compute=fp16"],
            "again": True,
        },
    },
}
# Each small card in a group of its own, core's server started last: Dynamic VRAM's headroom is measured at
# a server's start, so it counts the other servers' idle memory only where they were started before it.
for card, label, file in ((8, "basic", BASIC), (4, "low-VRAM", LOW_VRAM)):
    OTHERS[f"{card} GB card"] = {
        f"{ANCHOR}, beside the {card} GB card": {"anchor": True},
        f"{card} GB card: {label} workflow, as shipped": {"workflow": file, "card_gb": card},
        f"{card} GB card: {CORE}": {"core": True, "card_gb": card},
    }
for group, rows in OTHERS.items():
    ROWS |= rows
    GROUPS[group] = list(rows)
CORE_FILES = {  # ComfyUI models folder: file name
    "text_encoders": "t5xxl_fp16.safetensors",
    "diffusion_models": "pixart_sigma.safetensors",
    "vae": "pixart_sigma_vae.safetensors",
}
CPU_CHECK = {"size": 272, "steps": 2}
SUBJECTS = [
    "a red fox in fresh snow",
    "an old tram on a hillside street",
    "a glass teapot with blooming tea",
    "a koi pond under maple trees",
    "a desert canyon at noon",
    "a violin on a velvet chair",
    "a stone bridge over a misty river",
    "a market stall of ripe citrus",
    "a sailing boat in a storm",
    "a greenhouse full of orchids",
    "a robot reading in a library",
    "a field of lavender at sunset",
]
STYLES = ["photograph, 50mm", "oil painting", "watercolour", "isometric illustration"]


def prompt_of(index: int) -> tuple[str, int]:
    """The ``index``-th prompt of a run (0: each process's untimed first): its text and seed, none
    repeated within 48."""
    return f"{SUBJECTS[index % len(SUBJECTS)]}, {STYLES[index // len(SUBJECTS) % len(STYLES)]}", 1000 + index


# ---- the rows --------------------------------------------------------------------------------------


class Anchor:
    """diffusers' PixArtSigmaPipeline in fp16 with everything on the GPU (fp32 on the CPU), in this process;
    each prompt's image decoded and written as SaveImage writes it."""

    def __init__(self, model_dir: Path, work: Path, settings: dict):
        import torch
        from diffusers import PixArtSigmaPipeline

        self.cuda = torch.cuda.is_available() and not settings["cpu"]
        dtype = torch.float16 if self.cuda else torch.float32
        self.pipe = PixArtSigmaPipeline.from_pretrained(model_dir, dtype=dtype).to(
            "cuda" if self.cuda else "cpu"
        )
        self.work, self.settings, self.pid = work, settings, os.getpid()

    def __call__(self, index: int, text: str, seed: int) -> dict:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        s = self.settings
        with harness.GpuWatch([self.pid]) as watch:
            start = time.perf_counter()
            # Without autograd, as the pipeline runs; the decode called here must too.
            with torch.inference_mode():
                latents = self.pipe(
                    text,
                    width=s["size"],
                    height=s["size"],
                    num_inference_steps=s["steps"],
                    guidance_scale=harness.CFG,
                    generator=torch.Generator("cpu").manual_seed(seed),
                    output_type="latent",
                    return_dict=False,
                )[0]
                vae = self.pipe.vae
                image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
                image = (image.float().cpu() / 2 + 0.5).clamp(0, 1)
            generated = time.perf_counter() - start
            png = harness.save_png(image, self.work / f"anchor-{index}")
            seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "png_seconds": png,
            "generated_seconds": generated,
            "process_peak": watch.peak,
            "peak_allocated": torch.cuda.max_memory_allocated() if self.cuda else None,
        }


def write_core_files(model_dir: Path, tree: Path) -> None:
    """The diffusers folder's weights as the single files core's loaders read (once; reused if present)."""
    import torch

    from pixart_lowvram.cli.random_model import save_single_file_t5, save_single_file_transformer

    paths = {folder: tree / folder / name for folder, name in CORE_FILES.items()}
    if not paths["text_encoders"].is_file():
        save_single_file_t5(model_dir, paths["text_encoders"], dtype=torch.float16)
    if not paths["diffusion_models"].is_file():
        save_single_file_transformer(model_dir, paths["diffusion_models"])
    if not paths["vae"].is_file():  # diffusers' key layout: core's VAE converts it on load
        paths["vae"].parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_dir / "vae" / "diffusion_pytorch_model.safetensors", paths["vae"])


def core_workflow(settings: dict) -> dict:
    """ComfyUI core's own PixArt-Σ graph (API format) on :data:`CORE_FILES`. On the CPU check, the pack's
    T5 Encode and VAE Decode stand for CLIPLoader and VAELoader (they build T5-XXL and the SDXL VAE at full
    size, whatever the files hold)."""
    size, sampler = settings["size"], {"sampler_name": "dpmpp_2m", "scheduler": "normal", "denoise": 1.0}
    nodes = {
        "1": ("CLIPLoader", {"clip_name": CORE_FILES["text_encoders"], "type": "pixart"}),
        "2": ("CLIPTextEncode", {"clip": ["1", 0], "text": ""}),
        "3": ("CLIPTextEncode", {"clip": ["1", 0], "text": ""}),
        "4": ("UNETLoader", {"unet_name": CORE_FILES["diffusion_models"], "weight_dtype": "default"}),
        "5": ("EmptyLatentImage", {"width": size, "height": size, "batch_size": 1}),
        "6": (
            "KSampler",
            sampler
            | {"seed": 0, "steps": settings["steps"], "cfg": harness.CFG, "model": ["4", 0]}
            | {"positive": ["2", 0], "negative": ["3", 0], "latent_image": ["5", 0]},
        ),
        "7": ("VAELoader", {"vae_name": CORE_FILES["vae"]}),
        "8": ("VAEDecode", {"samples": ["6", 0], "vae": ["7", 0]}),
        "9": ("SaveImage", {"images": ["8", 0], "filename_prefix": "core"}),
    }
    if settings["cpu"]:
        del nodes["1"], nodes["3"], nodes["7"]
        encode = {"model": MODEL_NAME, "prompt": "", "negative_prompt": "", "quantization": "nf4"}
        nodes["2"] = ("PixArtQ_T5Encode", encode | {"keep_loaded": False, "low_vram": False})
        nodes["6"][1].update(positive=["2", 1], negative=["2", 2])
        decode = {"model": MODEL_NAME, "latent": ["6", 0], "keep_loaded": False, "tiling": "auto"}
        nodes["8"] = ("PixArtQ_VAEDecode", decode | {"vae_file": "(from model)"})
    return {key: {"class_type": kind, "inputs": inputs} for key, (kind, inputs) in nodes.items()}


def row_workflow(row: dict, settings: dict) -> dict:
    """The API workflow a server row queues, before each prompt's text and seed."""
    from pixart_lowvram.cli import client as api

    if row.get("core"):
        return core_workflow(settings)
    workflow = api.load_workflow(harness.REPO / "workflows" / "api" / row["workflow"])
    workflow = api.apply_overrides(harness.without(workflow, tuple(row.get("drop", ()))), row.get("sets", ()))
    if settings["cpu"]:
        workflow = api.apply_overrides(workflow, size=(settings["size"], settings["size"]))
        for node in workflow.values():
            if "steps" in node["inputs"]:
                node["inputs"]["steps"] = settings["steps"]
    return workflow


def server_args(row: dict, settings: dict) -> tuple[tuple[str, ...], tuple[str, ...], dict]:
    """A server row's launcher, ComfyUI arguments and environment: the row's ``env``; for a small card,
    benchmarks/card_limit.py, Dynamic VRAM's headroom (the real card's free memory now, less the card) and
    the card's size."""
    env = dict(row.get("env", {}))
    if "card_gb" not in row:
        return (), (), env
    launch = (str(Path(__file__).with_name("card_limit.py")),)
    env["PIXART_LOWVRAM_CARD_GIB"] = str(row["card_gb"])
    free = None if settings["cpu"] else harness.card_free()
    args = () if free is None else ("--vram-headroom", f"{max(free / harness.GIB - row['card_gb'], 0):.2f}")
    return launch, args, env


@contextmanager
def server_row(name: str, row: dict, settings: dict, work: Path):
    """A row's server, started; yields ``prompt(index, text, seed)``, which runs one prompt (submit to
    image downloaded) and gives its record."""
    import comfy_server

    from pixart_lowvram.cli import client as api

    base = work / name.replace(" ", "_").replace(":", "").replace("/", "")
    base.mkdir()
    if row.get("core"):
        tree = work.parent / "core_files"
        write_core_files(settings["model_dir"], tree)
        for folder, file in CORE_FILES.items():
            (base / "models" / folder).mkdir(parents=True, exist_ok=True)
            (base / "models" / folder / file).symlink_to(tree / folder / file)
    if row.get("workflow") == LORA:
        from pixart_lowvram.cli.random_model import save_random_lora

        save_random_lora(settings["model_dir"], base / "models" / "loras" / LORA_FILE, rank=16, scale=0.02)
    workflow = row_workflow(row, settings)
    launch, args, env = server_args(row, settings)
    row["server_args"], row["server_env"] = list(args), env
    with comfy_server.started(
        settings["comfyui"],
        base,
        {MODEL_NAME: settings["model_dir"]},
        sys.executable,
        cpu=settings["cpu"],
        extra_args=args,
        env=env | {"PIXART_LOWVRAM_QUANT_CACHE": str(work.parent / "quant_cache")},
        launch=launch,
    ) as server:
        client = api.Client(server.url)
        client.check(workflow)
        ws = client.connect()

        def run(index: int, text: str, seed: int) -> dict:
            if row.get("core"):
                prompt = api.apply_overrides(workflow, seed=seed)
                prompt["2"]["inputs"]["text" if "text" in prompt["2"]["inputs"] else "prompt"] = text
            else:
                prompt = api.apply_overrides(workflow, prompt=text, seed=seed)
            nodes: list[tuple[str | None, float]] = []

            def seen(kind: str, data: dict) -> None:
                if kind == "executing":
                    nodes.append((data.get("node"), time.perf_counter()))

            with harness.GpuWatch([server.pid]) as watch:
                start = time.perf_counter()
                client.run(ws, prompt, base / f"images-{index}", 1200, None, seen)
                seconds = time.perf_counter() - start
            took: dict[str, float] = {}
            for (node, began), (_, ended) in itertools.pairwise(nodes):
                kind = prompt[node]["class_type"]
                took[kind] = round(took.get(kind, 0.0) + ended - began, 3)
            return {"seconds": seconds, "node_seconds": took, "process_peak": watch.peak}

        try:
            yield run
        finally:
            if ws is not None:
                ws.close()
    if settings.get("logs"):  # the server stopped: its whole log
        settings["logs"].mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")
        shutil.copyfile(base / "server.log", settings["logs"] / f"{slug}.log")


# ---- a group ---------------------------------------------------------------------------------------


def run_group(group: str, settings: dict, rounds: int, until: float | None) -> dict:
    """The rows of ``group``: each started and given its first prompt, then ``rounds`` rounds (fewer where
    the next would end after ``until``, a ``time.time()``). Each row: its configuration, its first prompt,
    its timed prompts, and its error if it failed."""
    names = GROUPS[group]
    rows = {
        name: {"group": group, "config": dict(ROWS[name]), "first": None, "prompts": []} for name in names
    }
    work = Path(tempfile.mkdtemp(prefix="front-", dir=settings["work"]))
    runs = {}
    began = time.time()
    with ExitStack() as stack:
        for name in names:
            row = rows[name]
            try:
                if row["config"].get("again") and not any((settings["work"] / "quant_cache").glob("*")):
                    raise RuntimeError(
                        "started again: no workflow has run with this --work on this machine; run the card "
                        "group first, with the same --work"
                    )
                if row["config"].get("anchor"):
                    runs[name] = Anchor(settings["model_dir"], work, settings)
                else:
                    runs[name] = stack.enter_context(server_row(name, row["config"], settings, work))
                row["first"] = runs[name](0, *prompt_of(0))
            except Exception as exc:  # a row that cannot start or run is a result
                row["error"] = said(exc)
                runs.pop(name, None)
            print(f"{group}: {name}: started", file=sys.stderr)
        started = time.time()
        for index in range(1, rounds + 1):
            pace = (time.time() - started) / (index - 1) if index > 1 else 0.0
            if until and index > 1 and time.time() + pace > until:
                break
            text, seed = prompt_of(index)
            turn = (index - 1) % len(names)
            for name in names[turn:] + names[:turn]:
                if name not in runs:
                    continue
                try:
                    record = runs[name](index, text, seed)
                except Exception as exc:
                    rows[name]["error"] = f"round {index}: {said(exc)}"
                    runs.pop(name)
                    continue
                rows[name]["prompts"].append(record | {"round": index, "text": text, "seed": seed})
            print(f"{group}: round {index} done ({time.time() - began:.0f} s)", file=sys.stderr)
    runs.clear()  # the anchor's pipeline too: the next group loads its own
    gc.collect()
    if not settings["cpu"]:
        import torch

        torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)
    return rows


def summarize(rows: dict) -> dict:
    """Each row's mean and median seconds, × its group's anchor (mean over mean, median over median), and
    its peaks."""
    for row in rows.values():
        seconds = [p["seconds"] for p in row["prompts"]]
        row["summary"] = {
            "rounds": len(seconds),
            "mean": statistics.mean(seconds) if seconds else None,
            "median": statistics.median(seconds) if seconds else None,
            "process_peak": max((p["process_peak"] or 0 for p in row["prompts"]), default=None) or None,
            "first": (row["first"] or {}).get("seconds"),
        }
    for row in rows.values():
        anchor = next(r for r in rows.values() if r["group"] == row["group"] and r["config"].get("anchor"))
        for key in ("mean", "median"):
            mine, theirs = row["summary"][key], anchor["summary"][key]
            row["summary"][f"{key}_ratio"] = mine / theirs if mine and theirs else None
    return rows


# ---- the result and the docs --------------------------------------------------------------------------


def seconds(summary: dict, key: str = "mean") -> str:
    if summary.get(key) is None:
        return "–"
    ratio = summary.get(f"{key}_ratio")
    return f"{summary[key]:.2f} s" + ("" if ratio is None else f" ({ratio:.2f}×)")


def peak(row: dict) -> str:
    value, card = row["summary"]["process_peak"], row["config"].get("card_gb")
    if value is None:
        return "–"
    over = card is not None and value > card * harness.GIB
    return f"{value / harness.GIB:.2f} GiB" + (f" (over {card} GB)" if over else "")


def said(exc: Exception, keep: int = 2000) -> str:
    """An error as a row records it: its first line and the end of the rest (a server's log ends with
    the traceback that stopped it)."""
    text = f"{type(exc).__name__}: {exc}"
    first, _, rest = text.partition("\n")
    return first if not rest else f"{first}\n{rest[-keep:]}"


def outcome(row: dict) -> str:
    if "error" not in row:
        return ""
    error = row["error"]
    return "out of memory" if "OutOfMemoryError" in error or "out of memory" in error.lower() else "failed"


def group_table(result: dict, group: str) -> list[str]:
    lines = []
    for name, row in result["rows"].items():
        if row["group"] != group:
            continue
        s = row["summary"]
        mean = seconds(s) if "error" not in row else f"{outcome(row)}; {seconds(s)}"
        first = "–" if s["first"] is None else f"{s['first']:.1f} s"
        lines.append([name, mean, seconds(s, "median"), peak(row), f"{s['rounds']}", first])
    header = ["row", "mean (× anchor)", "median (× anchor)", "peak GPU memory", "prompts", "first prompt"]
    return harness.table(header, lines)


def every_prompt(result: dict) -> list[str]:
    rounds = max(len(row["prompts"]) for row in result["rows"].values())
    lines = [
        [name, *(f"{p['seconds']:.2f}" for p in row["prompts"]), *[""] * (rounds - len(row["prompts"]))]
        for name, row in result["rows"].items()
    ]
    return harness.table(["row", *(f"round {i + 1}" for i in range(rounds))], lines)


def markdown(result: dict) -> str:
    """front.md: the groups' tables, every prompt's seconds, and each row's error."""
    parts = [
        "Seconds per prompt, submit to image downloaded, new text and seed each; × over the anchor of the same "
        "group. Peak GPU memory: the row's process on the card (NVML), its CUDA context included. First "
        "prompt: the untimed one after the server's start (loading, quantizing, compiling; the pre-quantized "
        "weights are written by the first pack row of a run and read by the others).",
    ]
    for group in GROUPS:
        if any(row["group"] == group for row in result["rows"].values()):
            parts += ["", f"## {group}", "", *group_table(result, group)]
    parts += ["", "## every prompt (seconds)", "", *every_prompt(result)]
    errors = [f"- {name}: {row['error']}" for name, row in result["rows"].items() if "error" in row]
    if errors:
        parts += ["", "## errors", "", *errors]
    return "\n".join(parts)


def readme_table(result: dict) -> str:
    """README's figures: every row of the result, its mean and its peak."""
    lines = []
    for name, row in result["rows"].items():
        if row["config"].get("anchor") and name != ANCHOR:
            continue  # each group's anchor is the same configuration: README shows the first
        mean = seconds(row["summary"]) if "error" not in row else outcome(row)
        lines.append([name, peak(row), mean])
    stamp = result["stamp"]
    head = (
        f"{stamp['gpu']}, {stamp['date'][:10]}, commit `{(stamp.get('commit') or stamp['tree'])[:7]}`, "
        f"ComfyUI {stamp.get('comfyui')}: `{result['command']}` ([front.md](benchmarks/results/front.md))."
    )
    return "\n".join([head, "", *harness.table(["configuration", "peak GPU memory", "per prompt"], lines)])


# The generated blocks of the docs: file, and what goes between its markers.
BEGIN, END = "<!-- front.json: generated by benchmarks/front.py --render -->", "<!-- end of front.json -->"


NO_RESULT = "No figures: benchmarks/results/front.json has not been measured at this commit."


def docs(result: dict | None) -> dict[Path, str]:
    """README.md and docs/BENCHMARKS.md with their generated blocks made from ``result`` (None: no result)."""
    made = {}
    for path, block in (
        (harness.REPO / "README.md", readme_table(result) if result else NO_RESULT),
        (
            harness.REPO / "docs" / "BENCHMARKS.md",
            harness.markdown_text(TITLE, result, markdown).split("\n", 2)[2] if result else NO_RESULT,
        ),
    ):
        text = path.read_text(encoding="utf-8")
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{path.name} has no block between {BEGIN} and {END}")
        before, rest = text.split(BEGIN, 1)
        made[path] = f"{before}{BEGIN}\n{block.strip()}\n{END}{rest.split(END, 1)[1]}"
    return made


def combine(paths: list[Path]) -> dict:
    """The groups' results as one: the same tree and GPU, else SystemExit."""
    results = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    first = results[0]
    for other in results[1:]:
        for key in ("tree", "gpu", "gpu_uuid"):
            if other["stamp"].get(key) != first["stamp"].get(key):
                raise SystemExit(
                    f"--combine: {key} differs: {first['stamp'].get(key)} / {other['stamp'].get(key)}"
                )
    rows = {name: row for result in results for name, row in result["rows"].items()}
    commands = " && ".join(r["command"] for r in results)
    stamp = first["stamp"] | harness.commit_of(first["stamp"]["tree"])
    return first | {"stamp": stamp, "command": commands, "rows": {n: rows[n] for n in ROWS if n in rows}}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, NAME, comfyui=True)
    p.add_argument("--group", choices=list(GROUPS), action="append", help="a group of rows (all by default)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of timed prompts (%(default)s)")
    p.add_argument("--until", type=float, help="seconds: start no round that would end later than this")
    p.add_argument("--cpu-check", action="store_true", help="CPU servers, 272², 2 steps: that it runs")
    p.add_argument(
        "--work",
        type=Path,
        help="a folder for core's single files and the pre-quantized weights, kept for the next call "
        "(default: a new temporary folder, removed at the end)",
    )
    p.add_argument("--combine", nargs="+", type=Path, help="front.json files of one tree's groups, joined")
    p.add_argument(
        "--check", action="store_true", help="exit 1 if front.md or a doc's table is not front.json's"
    )
    p.add_argument("--rows", action="store_true", help="print the rows and groups as JSON, and stop")
    p.add_argument("--logs", type=Path, help="a folder for each server's log, copied when it stops")
    args = p.parse_args(argv)
    if args.rows:
        print(json.dumps({"rows": ROWS, "groups": GROUPS}, indent=1))
        return 0
    if args.combine:
        result = combine(args.combine)
        harness.write(
            args,
            {k: v for k, v in result.items() if k not in ("stamp", "arguments", "command")},
            run={k: result[k] for k in ("stamp", "arguments", "command")},
            title=TITLE,
            render=markdown,
        )
        args.render = True
    if args.render or args.check:
        result = harness.load(args.out, NAME)
        made = docs(result)
        if result is not None:
            made[args.out / f"{NAME}.md"] = harness.markdown_text(TITLE, result, markdown)
        stale = [
            path
            for path, text in made.items()
            if not path.is_file() or path.read_text(encoding="utf-8") != text
        ]
        if args.check:
            print("\n".join(f"not as front.json makes it: {path.name}" for path in stale))
            return 1 if stale else 0
        for path in stale:
            path.write_text(made[path], encoding="utf-8")
        return 0
    if args.model_dir is None or args.comfyui is None:
        p.error("give --model-dir and --comfyui")
    settings = {
        "model_dir": args.model_dir.resolve(),
        "comfyui": args.comfyui.resolve(),
        "cpu": args.cpu_check,
        "size": CPU_CHECK["size"] if args.cpu_check else harness.SIZE,
        "steps": CPU_CHECK["steps"] if args.cpu_check else harness.STEPS,
        "logs": args.logs,
    }
    run = harness.run(p, args, args.comfyui, ("comfy-aimdo", "comfy-kitchen"))
    until = time.time() + args.until if args.until else None
    rows: dict = {}
    with tempfile.TemporaryDirectory(prefix="front-") as scratch:
        settings["work"] = args.work or Path(scratch)
        settings["work"].mkdir(parents=True, exist_ok=True)
        for group in args.group or GROUPS:
            if until and time.time() > until:
                print(f"{group}: not started, past --until", file=sys.stderr)
                continue
            rows |= run_group(group, settings, args.rounds, until)
            # after each group: a run cut short keeps the groups it finished
            result = harness.write(args, {"rows": summarize(rows)}, run=run, title=TITLE, render=markdown)
    if not rows:
        return 1
    print(harness.markdown_text(TITLE, result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
