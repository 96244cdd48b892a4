"""The ComfyUI sequence: the pack in a real ComfyUI server, through the HTTP API and the websocket, step by
step, with the server's device memory read after each step (tests/test_comfyui_gpu.py runs it on the GPU
with the tiny model).

The steps, in order (each one bounded by a timeout; a failed step does not stop the ones after it):
  1. pack loaded: /object_info has the pack's node types, the startup log no Traceback and no import failure
     (ComfyUI's own optional nodes that fail to import for a missing package, e.g. comfy_extras/
     nodes_audio.py without torchaudio, log a Traceback too: those are counted apart, as the environment's);
  2. every bundled API workflow (workflows/api/*_api.json) succeeds: model, size and steps set with
     the client's override helpers (cli/client.py), keep_loaded as bundled;
  3. keep_loaded on in every node: two prompts;
  4. POST /free (unload_models, free_memory): ComfyUI moves the three kept models off the device (the log's
     "ComfyUI moved pack model" lines; /free is posted again every 10 s until they show: a /free that
     reaches the worker while it finishes a prompt is seen only at its next wake-up). On a GPU too small
     to hold all three at once ComfyUI offloads some during the prompts already, and fewer show here;
  5. a third prompt (keep_loaded on) succeeds (loading the models again: with free_memory ComfyUI dropped
     its node cache, and with the pack's node objects the pack let go of its models);
  6. Cancel: a prompt of ``Settings.cancel_steps`` steps, POST /interrupt once the sampler's first ``progress``
     message arrives; it must end interrupted, and
  7. the next prompt succeed;
  8. a core model after kept pack models: the basic workflow (keep_loaded on) plus core VAELoader
     (sdxl_vae.safetensors) → VAEDecode → SaveImage, so ComfyUI's own manager makes room for its VAE with
     the pack's kept models in its list;
  9. POST /free again, as in 4.

Memory: GET /system_stats before the first prompt and after each step. For a CUDA device ComfyUI reports
``vram_total``, ``vram_free`` (the device's free memory plus what torch has reserved but not in use),
``torch_vram_total`` (torch's reserved bytes) and ``torch_vram_free`` (reserved - active), so allocated =
``torch_vram_total - torch_vram_free``. Memory ComfyUI's Dynamic VRAM (comfy-aimdo) holds outside torch's
caching allocator shows in ``vram_free`` only, which is recorded too.

Criteria (:func:`judge`):
  * every step succeeded;
  * no "Traceback" in the server log but those of ComfyUI's own nodes failing to import (counted apart);
  * (CUDA only) allocated memory after each POST /free within ``Settings.limit_mib`` MiB of the level before
    the first prompt.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import comfy_server
from comfy_server import ServerError

from pixart_lowvram.cli import client as api

REPO = comfy_server.REPO
API_WORKFLOWS = REPO / "workflows" / "api"
BASE_WORKFLOW = API_WORKFLOWS / "pixart_lowvram_basic_api.json"
# Needs ComfyUI-Distributed's nodes beside the pack (tests/test_comfyui_distributed.py runs it).
DISTRIBUTED_WORKFLOW = API_WORKFLOWS / "pixart_lowvram_distributed_api.json"
T5, SAMPLER = "PixArtQ_T5Encode", "PixArtQ_Sampler"
NODE_IDS = (T5, SAMPLER, "PixArtQ_VAEDecode", "PixArtQ_FreeVRAM", "PixArtQ_MemorySnapshot")
KEPT_MODELS = 3  # T5, transformer, VAE: what keep_loaded on every node keeps
SDXL_VAE_FILE = "sdxl_vae.safetensors"
MIB = 2**20

# Log lines: the pack's (nodes/comfy_models.py, core/pool.py) and ComfyUI's (main.py, nodes.py).
MOVED = "ComfyUI moved pack model"
REUSED = "reusing kept model"
DYNAMIC_VRAM_ENABLED = "DynamicVRAM support detected and enabled"
DYNAMIC_VRAM_DISABLED = (
    "DynamicVRAM support disabled",
    "DynamicVRAM support requires",
    "Dynamic vram disabled with argument",
)
DYNAMIC_VRAM_LINE = re.compile(r"dynamic ?vram|aimdo", re.IGNORECASE)
IMPORT_FAILED = ("IMPORT FAILED", "Cannot import")
# nodes.py, after the Traceback of a node module that failed to import (ComfyUI's own or a custom one).
CANNOT_IMPORT = re.compile(r"Cannot import (.+?) module for custom nodes")

FREE_REPOST_S = 10.0  # seconds between POST /free while its effect has not shown
SETTLE_MIN_S, SETTLE_MAX_S = 2.0, 15.0  # after /free: the worker's gc and empty_cache follow the unload
POLL_S = 0.5
LOG_TAIL = 80

logger = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step ran but its outcome is not the one required; the message says how."""


@dataclass
class Settings:
    model: str  # the model's name on the server (its folder in models/diffusers)
    size: int = 512
    # core's EmptyLatentImage before KSampler on the int8 MODEL (None: size); ComfyUI's PixArt needs 272 px
    # or more, the tiny model's native size is 64.
    ksampler_size: int | None = None
    steps: int = 20
    cancel_steps: int = 1000
    limit_mib: float = 64.0
    prompt_timeout: float = 600.0
    free_timeout: float = 120.0
    workflows: list[Path] = field(
        default_factory=lambda: sorted(set(API_WORKFLOWS.glob("*_api.json")) - {DISTRIBUTED_WORKFLOW})
    )


# ---- prompts ----------------------------------------------------------------------------------------


def node_id(workflow: dict, class_type: str) -> str:
    (found,) = [key for key, node in workflow.items() if node["class_type"] == class_type]
    return found


def overrides(workflow: dict, steps: int, keep: bool | None) -> list[str]:
    """``NODE.INPUT=VALUE`` assignments: the steps of the pack's sampler or core's KSampler, and keep_loaded
    everywhere when ``keep`` is given (the model and size go by the client's --model and --size)."""
    sets = []
    for key, node in workflow.items():
        if node["class_type"] in (SAMPLER, "KSampler"):
            sets.append(f"{key}.steps={steps}")
        if keep is not None and "keep_loaded" in node.get("inputs", {}):
            sets.append(f"{key}.keep_loaded={keep}")
    return sets


def build_prompt(
    path: Path, settings: Settings, index: int, keep: bool | None = None, steps: int | None = None
) -> dict:
    """The API workflow at ``path`` for this server, with a T5 text and seed of its own (``index``), so
    ComfyUI's cache runs every node again; its model and size set as ``queue --model --size`` sets them
    (core's empty latent before KSampler takes ``ksampler_size``)."""
    workflow = api.load_workflow(path)
    sets = overrides(workflow, steps or settings.steps, keep)
    text = next(node["inputs"]["prompt"] for node in workflow.values() if node["class_type"] == T5)
    core_latent = any(node["class_type"] == "EmptyLatentImage" for node in workflow.values())
    size = (settings.ksampler_size or settings.size) if core_latent else settings.size
    return api.apply_overrides(
        workflow,
        sets,
        prompt=f"{text}, sequence {index}",
        seed=index,
        model=settings.model,
        size=(size, size),
    )


def with_core_decode(prompt: dict, prefix: str) -> dict:
    """``prompt`` plus core VAELoader (sdxl_vae.safetensors) → VAEDecode → SaveImage on its sampler's latent."""
    latent = [node_id(prompt, SAMPLER), 0]
    return prompt | {
        "core_vae": {"class_type": "VAELoader", "inputs": {"vae_name": SDXL_VAE_FILE}},
        "core_decode": {"class_type": "VAEDecode", "inputs": {"samples": latent, "vae": ["core_vae", 0]}},
        "core_save": {
            "class_type": "SaveImage",
            "inputs": {"images": ["core_decode", 0], "filename_prefix": prefix},
        },
    }


def write_sdxl_vae(model_dir: Path, target: Path, given: Path | None = None) -> Path:
    """``target``: ``given``, or the model folder's VAE in the original (ldm) key layout that core
    VAELoader needs (PixArt-Σ's VAE is the SDXL VAE)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if given is not None:
        shutil.copyfile(given, target)
        return target
    names = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors")
    source = next((model_dir / "vae" / n for n in names if (model_dir / "vae" / n).is_file()), None)
    if source is None:
        raise ServerError(f"{model_dir}/vae has none of {', '.join(names)}; give --vae-file")
    from safetensors.torch import load_file, save_file
    from vae_layout import to_original_layout

    save_file(to_original_layout(load_file(source)), target)
    return target


# ---- the server -------------------------------------------------------------------------------------


def memory(client: api.Client) -> dict:
    """The primary device's memory as /system_stats reports it; allocated, reserved and free are None
    unless it is a CUDA device (for the CPU ComfyUI reports the machine's RAM)."""
    device = client.get("/system_stats")["devices"][0]
    record = {"device": device.get("type"), "allocated": None, "reserved": None, "free": None}
    if device.get("type") == "cuda":
        record.update(
            allocated=device["torch_vram_total"] - device["torch_vram_free"],
            reserved=device["torch_vram_total"],
            free=device["vram_free"],
            total=device["vram_total"],
            torch_free=device["torch_vram_free"],
        )
    return record


def succeeded(entry: dict) -> bool:
    status = entry.get("status") or {}
    return status.get("status_str") == "success" and bool(status.get("completed"))


def interruption(entry: dict) -> dict | None:
    for kind, data in (entry.get("status") or {}).get("messages", []):
        if kind == "execution_interrupted":
            return data
    return None


class Sequence:
    """The steps against one server; ``steps`` holds each step's record."""

    def __init__(self, url: str, log: Path, settings: Settings):
        self.client = api.Client(url)
        self.log = Path(log)
        self.settings = settings
        self.steps: list[dict] = []
        self.prompts = 0

    # -- helpers

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_text(self, start: int = 0) -> str:
        with self.log.open("rb") as f:
            f.seek(start)
            return f.read().decode("utf-8", "replace")

    def post(self, path: str, body: dict) -> None:
        response = self.client._request("POST", path, json=body)
        if not response.ok:
            raise api.ClientError(f"POST {path} answered {response.status_code}: {response.text[:500]}")

    def prompt(self, path: Path = BASE_WORKFLOW, keep: bool | None = None, steps: int | None = None) -> dict:
        self.prompts += 1
        return build_prompt(path, self.settings, self.prompts, keep, steps)

    def run_prompt(
        self, prompt: dict, record: dict, on_message: Callable[[str, dict], None] | None = None
    ) -> dict:
        """Queue ``prompt`` and follow it to its end (``on_message`` sees each of its messages); its
        history entry. A prompt that is not followed to its end (its timeout) is interrupted, so the steps
        after it do not queue behind it."""
        self.client.check(prompt)
        prompt_id = record["prompt_id"] = str(uuid.uuid4())
        ws = self.client.connect()
        try:
            self.client.submit(prompt, prompt_id)
            try:
                return self.client.wait(ws, prompt_id, self.settings.prompt_timeout, None, on_message)
            except api.ClientError:
                with contextlib.suppress(api.ClientError):
                    self.post("/interrupt", {"prompt_id": prompt_id})
                raise
        finally:
            if ws is not None:
                ws.close()

    def run_ok(self, prompt: dict, record: dict) -> dict:
        entry = self.run_prompt(prompt, record)
        if not succeeded(entry):
            raise StepFailed(api.failure_text(record["prompt_id"], entry))
        record["images"] = sum(
            1
            for output in entry.get("outputs", {}).values()
            for image in output.get("images", [])
            if image.get("type") == "output"
        )
        return entry

    def step(self, name: str, action: Callable[[dict], None]) -> dict:
        """Run one step; record its outcome, seconds, the pack's log lines in its span and memory after."""
        record: dict = {"name": name}
        start, clock = self.log_size(), time.monotonic()
        try:
            action(record)
            record["passed"] = True
        except (StepFailed, api.ClientError, ServerError) as exc:
            record.update(passed=False, error=str(exc))
        except Exception as exc:  # the sequence goes on; the record says what broke
            record.update(passed=False, error=f"{type(exc).__name__}: {exc}")
        record["seconds"] = round(time.monotonic() - clock, 2)
        span = self.log_text(start)
        record["log"] = {
            "moved": span.count(MOVED),
            "reused": span.count(REUSED),
            "tracebacks": tracebacks(span)["tracebacks"],
        }
        try:
            record["memory"] = memory(self.client)
        except api.ClientError as exc:
            record["memory"] = None
            record["passed"] = False
            record.setdefault("error", f"/system_stats: {exc}")
        self.steps.append(record)
        allocated = (record["memory"] or {}).get("allocated")
        logger.info(
            "%-28s %s %7.1f s%s%s",
            name,
            "ok    " if record["passed"] else "FAILED",
            record["seconds"],
            "" if allocated is None else f", allocated {allocated / MIB:.1f} MiB",
            f": {record['error']}" if "error" in record else "",
        )
        return record

    # -- the steps

    def pack_loaded(self, record: dict) -> None:
        info = self.client.get("/object_info")
        missing = [n for n in NODE_IDS if n not in info]
        startup = self.log_text()
        failures = [
            line
            for line in startup.splitlines()
            if comfy_server.PACK_LINK in line and any(text in line for text in IMPORT_FAILED)
        ]
        counts = tracebacks(startup)
        tracebacks_ = counts["tracebacks"]
        record["detail"] = (
            f"{len(NODE_IDS) - len(missing)} of {len(NODE_IDS)} node types on the server; "
            f"{tracebacks_} Traceback(s) in the startup log"
            + (
                f" besides {counts['core_import']} of ComfyUI's own nodes failing to import"
                if counts["core_import"]
                else ""
            )
        )
        problems = [f"missing node types {', '.join(missing)}"] if missing else []
        problems += failures + ([f"{tracebacks_} Traceback(s) in the startup log"] if tracebacks_ else [])
        if problems:
            raise StepFailed("; ".join(problems))

    def workflow(self, path: Path) -> Callable[[dict], None]:
        def action(record: dict) -> None:
            self.run_ok(self.prompt(path), record)

        return action

    def kept_prompt(self, record: dict) -> None:
        self.run_ok(self.prompt(keep=True), record)

    def free(self, record: dict) -> None:
        """POST /free until the log shows ComfyUI moving the kept models, then wait for the memory to
        settle (the worker collects garbage and empties torch's cache right after the unload)."""
        start, posts = self.log_size(), 0
        deadline = time.monotonic() + self.settings.free_timeout
        while True:
            self.post("/free", {"unload_models": True, "free_memory": True})
            posts += 1
            repost = min(deadline, time.monotonic() + FREE_REPOST_S)
            while self.log_text(start).count(MOVED) < KEPT_MODELS and time.monotonic() < repost:
                time.sleep(0.2)
            moved = self.log_text(start).count(MOVED)
            if moved >= KEPT_MODELS:
                break
            if time.monotonic() >= deadline:
                raise StepFailed(
                    f"{posts} POST /free in {self.settings.free_timeout:g} s: the log shows {moved} of "
                    f"{KEPT_MODELS} {MOVED!r}"
                )
        record["posts"] = posts
        record["settle_seconds"] = self.settle()
        record["detail"] = f"{moved} kept models moved off the device after {posts} POST /free"

    def settle(self) -> float:
        """Seconds until three readings of /system_stats, POLL_S apart, agree (at least SETTLE_MIN_S)."""
        clock = time.monotonic()
        time.sleep(SETTLE_MIN_S)
        readings = [memory(self.client)]
        while time.monotonic() - clock < SETTLE_MAX_S:
            time.sleep(POLL_S)
            readings.append(memory(self.client))
            last = [(r["allocated"], r["reserved"]) for r in readings[-3:]]
            if len(last) == 3 and len(set(last)) == 1:
                break
        return round(time.monotonic() - clock, 2)

    def cancel(self, record: dict) -> None:
        prompt = self.prompt(keep=True, steps=self.settings.cancel_steps)
        sampler = node_id(prompt, SAMPLER)
        sent: dict = {}

        def on_message(kind: str, data: dict) -> None:
            if kind == "progress" and data.get("node") == sampler and not sent:
                sent.update(step=data.get("value"), of=data.get("max"), clock=time.monotonic())
                self.post("/interrupt", {"prompt_id": data["prompt_id"]})

        entry = self.run_prompt(prompt, record, on_message)
        if not sent:
            raise StepFailed(f"no progress message from the sampler (node {sampler}) before the prompt ended")
        record["interrupted_at"] = f"step {sent['step']} of {sent['of']}"
        record["stopped_after_s"] = round(time.monotonic() - sent["clock"], 2)
        stopped = interruption(entry)
        if stopped is None:
            if succeeded(entry):
                raise StepFailed(f"the prompt ran all {sent['of']} steps: the interrupt did not stop it")
            raise StepFailed(api.failure_text(record["prompt_id"], entry))
        record["detail"] = (
            f"POST /interrupt at the sampler's {record['interrupted_at']}; ended interrupted in "
            f"{stopped.get('node_type')} {record['stopped_after_s']} s later"
        )

    def core_after_kept(self, record: dict) -> None:
        entry = self.run_ok(with_core_decode(self.prompt(keep=True), "sequence_core"), record)
        if not entry["outputs"].get("core_save", {}).get("images"):
            raise StepFailed("core SaveImage wrote no image")
        record["detail"] = "core VAE loaded with the pack's models kept"


# ---- the run ----------------------------------------------------------------------------------------


def traceback_blocks(lines: list[str]) -> list[tuple[int, int]]:
    """(first, end) line indices of each Traceback: up to the next one, or 40 lines."""
    starts = [i for i, line in enumerate(lines) if "Traceback" in line]
    return [(start, min([*starts[k + 1 :], start + 40, len(lines)])) for k, start in enumerate(starts)]


def core_import_failure(block: list[str]) -> bool:
    """Whether a Traceback is ComfyUI's own node module failing to import (nodes.py says so right after)."""
    for line in block:
        match = CANNOT_IMPORT.search(line)
        if match:
            return comfy_server.PACK_LINK not in match[1] and "custom_nodes" not in match[1]
    return False


def tracebacks(text: str) -> dict:
    """The Tracebacks in ``text``: ``tracebacks`` counts all but ``core_import`` (ComfyUI's own optional
    nodes that failed to import: the environment's, not the pack's)."""
    lines = text.splitlines()
    core = sum(core_import_failure(lines[a:b]) for a, b in traceback_blocks(lines))
    return {"tracebacks": text.count("Traceback") - core, "core_import": core}


def log_report(text: str) -> dict:
    lines = text.splitlines()
    if DYNAMIC_VRAM_ENABLED in text:
        dynamic = "enabled"
    elif any(line in text for line in DYNAMIC_VRAM_DISABLED):
        dynamic = "disabled"
    else:
        dynamic = "not announced"
    blocks = [(a, b) for a, b in traceback_blocks(lines) if not core_import_failure(lines[a:b])]
    return {
        "dynamic_vram": dynamic,
        "dynamic_vram_lines": [line for line in lines if DYNAMIC_VRAM_LINE.search(line)],
        **tracebacks(text),
        "core_import_failures": list(
            dict.fromkeys(m[1] for m in map(CANNOT_IMPORT.search, lines) if m and "custom_nodes" not in m[1])
        ),
        "traceback_excerpts": ["\n".join(lines[a:b]) for a, b in blocks[:3]],
        "tail": lines[-LOG_TAIL:],
    }


def judge(result: dict, settings: Settings) -> list[dict]:
    steps = result["steps"]
    failed = [s["name"] for s in steps if not s["passed"]]
    checks = [
        {
            "name": "every step succeeded",
            "passed": not failed,
            "detail": f"{len(steps) - len(failed)} of {len(steps)} steps"
            + (f"; failed: {', '.join(failed)}" if failed else ""),
        },
        {
            "name": "no Traceback in the server log",
            "passed": result["log"]["tracebacks"] == 0,
            "detail": f"{result['log']['tracebacks']} Traceback(s)"
            + (
                f" (and {result['log']['core_import']} of ComfyUI's own optional nodes failing to import, "
                "not counted)"
                if result["log"]["core_import"]
                else ""
            ),
        },
    ]
    memory_check = {
        "name": f"allocated after /free within {settings.limit_mib:g} MiB of before the first prompt",
        "limit_mib": settings.limit_mib,
    }
    before = (result.get("before") or {}).get("allocated")
    frees = [s for s in steps if s["name"].endswith("/free")]
    after = {s["name"]: (s.get("memory") or {}).get("allocated") for s in frees}
    if before is None:
        memory_check |= {"passed": None, "detail": "no CUDA: ComfyUI reports no allocator figures here"}
    elif not after or None in after.values():
        memory_check |= {"passed": False, "detail": "no /system_stats reading after a /free"}
    else:
        deviations = {name: value - before for name, value in after.items()}
        memory_check |= {
            "passed": all(abs(d) <= settings.limit_mib * MIB for d in deviations.values()),
            "before_mib": round(before / MIB, 2),
            "after_mib": {name: round(value / MIB, 2) for name, value in after.items()},
            "detail": f"before the first prompt {before / MIB:.1f} MiB; "
            + "; ".join(
                f"after {name} {after[name] / MIB:.1f} MiB ({deviations[name] / MIB:+.1f})" for name in after
            ),
        }
    checks.append(memory_check)
    return checks


def run_sequence(url: str, log: Path, settings: Settings) -> dict:
    """Every step against the server at ``url`` (its log at ``log``); the result with its checks."""
    sequence = Sequence(url, log, settings)
    system = sequence.client.get("/system_stats")
    result: dict = {
        "settings": asdict(settings) | {"workflows": [p.name for p in settings.workflows]},
        "server": {
            "url": url,
            "comfyui": system["system"].get("comfyui_version"),
            "pytorch": system["system"].get("pytorch_version"),
            "argv": system["system"].get("argv"),
            "device": system["devices"][0].get("name"),
            "device_type": system["devices"][0].get("type"),
        },
    }
    step = sequence.step
    result["before"] = step("pack loaded", sequence.pack_loaded)["memory"]  # before the first prompt
    for path in settings.workflows:
        step(f"workflow {path.name}", sequence.workflow(path))
    step("keep_loaded prompt 1", sequence.kept_prompt)
    step("keep_loaded prompt 2", sequence.kept_prompt)
    step("/free", sequence.free)
    step("keep_loaded prompt 3", sequence.kept_prompt)
    step("cancel during sampling", sequence.cancel)
    step("prompt after cancel", sequence.kept_prompt)
    step("core VAE after kept models", sequence.core_after_kept)
    step("final /free", sequence.free)
    result["steps"] = sequence.steps
    result["log"] = log_report(sequence.log_text())
    result["checks"] = judge(result, settings)
    result["memory_check"] = result["checks"][-1]
    return result
