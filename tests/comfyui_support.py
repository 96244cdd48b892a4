"""What the ``comfyui`` tier shares: a real ComfyUI server started on a free local port (``running_server``;
the ``server`` fixture in conftest.py starts one per test module), a client that queues prompts and follows
the websocket, and the bundled basic workflow as a prompt for the tiny model (its name, size and steps:
tools/tiny_workflows.py).

Needs COMFYUI_PATH (a ComfyUI checkout); COMFYUI_PYTHON names its interpreter (default: this one).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from PIL import Image
from tiny_workflows import MODEL, SIZE, STEPS

REPO = Path(__file__).resolve().parents[1]
API_WORKFLOW = REPO / "workflows" / "api" / "pixart_lowvram_basic_api.json"
UI_WORKFLOW = REPO / "workflows" / "pixart_lowvram_basic.json"
KSAMPLER_API_WORKFLOW = API_WORKFLOW.with_name("pixart_lowvram_lora_ksampler_api.json")

NODE_IDS = (
    "PixArtQ_T5Encode",
    "PixArtQ_Sampler",
    "PixArtQ_VAEDecode",
    "PixArtQ_FreeVRAM",
    "PixArtQ_MemorySnapshot",
    "PixArtQ_ModelLoader",
    "PixArtQ_LoRA",
    "PixArtQ_BatchedGuidance",
)
MODEL_NODES = ("PixArtQ_T5Encode", "PixArtQ_Sampler", "PixArtQ_VAEDecode")
HUB_ID = "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"
SDXL_VAE_FILE = "sdxl_vae.safetensors"  # in models/vae when running_server is given sdxl_vae_file
PACK_LINK = "comfyui-pixart-lowvram"  # the pack's folder name in custom_nodes/ (comfy_server.py)

START_TIMEOUT = 240  # seconds; a cold start on a small CPU machine takes 20-40 s
PROMPT_TIMEOUT = 300
HTTP_TIMEOUT = 30
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# protocol.BinaryEventTypes: a preview with its node and prompt ids, sent to clients that announce
# supports_preview_metadata as ComfyUI's web UI does.
PREVIEW_IMAGE_WITH_METADATA = 4
PREVIEW_SIZE = 512  # ComfyUI's --preview-size default: it scales every preview to fit this square


@dataclass
class Preview:
    """A preview image sent over the websocket as a binary frame during a node's run."""

    node: str
    mimetype: str
    data: bytes

    def image(self) -> Image.Image:
        image = Image.open(io.BytesIO(self.data))
        image.load()
        return image


@dataclass
class Run:
    """One prompt as the client saw it: its websocket messages and previews in order, and its /history
    entry."""

    prompt_id: str
    messages: list[tuple[str, dict]]
    previews: list[Preview]
    history: dict

    @property
    def status(self) -> str:
        return self.history["status"]["status_str"]

    @property
    def outputs(self) -> dict:
        return self.history["outputs"]

    def of_type(self, kind: str) -> list[dict]:
        return [data for message_type, data in self.messages if message_type == kind]

    @property
    def error(self) -> dict | None:
        errors = self.of_type("execution_error")
        return errors[0] if errors else None

    @property
    def executed(self) -> list[str]:
        """Node ids in the order they ran (cached nodes do not run)."""
        return [data["node"] for data in self.of_type("executing") if data["node"] is not None]

    def text(self, node_id: str) -> str:
        return "\n".join(self.outputs[node_id]["text"])


@dataclass
class ComfyServer:
    url: str
    base: Path
    log: Path
    pid: int = 0  # the server process (it leads its own process group)

    @property
    def output(self) -> Path:
        return self.base / "output"

    @property
    def models(self) -> Path:
        return self.base / "models" / "diffusers"

    def get(self, path: str) -> dict:
        response = requests.get(self.url + path, timeout=HTTP_TIMEOUT)
        response.raise_for_status()
        return response.json()

    def queue(
        self, prompt: dict, client_id: str = "", prompt_id: str = "", extra_data: dict | None = None
    ) -> requests.Response:
        body = {"prompt": prompt, "client_id": client_id or uuid.uuid4().hex}
        body["prompt_id"] = prompt_id or str(uuid.uuid4())
        if extra_data:
            body["extra_data"] = extra_data
        return requests.post(self.url + "/prompt", json=body, timeout=HTTP_TIMEOUT)

    def run(
        self,
        prompt: dict,
        timeout: float = PROMPT_TIMEOUT,
        extra_data: dict | None = None,
        on_message: OnMessage | None = None,
    ) -> Run:
        """Queue ``prompt`` and follow the websocket until ComfyUI reports it done. The client announces
        preview metadata as the web UI does; ``on_message`` sees each of the prompt's messages as it
        arrives."""
        import websocket  # websocket-client: only this tier needs it

        client_id, prompt_id = uuid.uuid4().hex, str(uuid.uuid4())
        ws = websocket.create_connection(
            self.url.replace("http://", "ws://") + f"/ws?clientId={client_id}", timeout=HTTP_TIMEOUT
        )
        try:
            flags = {"type": "feature_flags", "data": {"supports_preview_metadata": True}}
            ws.send(json.dumps(flags))
            response = self.queue(prompt, client_id, prompt_id, extra_data)
            assert response.status_code == 200, f"ComfyUI refused the prompt: {response.text}"
            messages, previews = follow(ws, prompt_id, timeout, on_message)
        finally:
            ws.close()
        return Run(prompt_id, messages, previews, self.get(f"/history/{prompt_id}")[prompt_id])

    def log_text(self, start: int = 0) -> str:
        with self.log.open("rb") as f:
            f.seek(start)
            return f.read().decode("utf-8", "replace")


OnMessage = Callable[[str, dict], None]


def progress_is_throttled() -> bool:
    """Whether the ComfyUI under test holds back progress messages: from about v0.30 its ProgressBar sends
    the first and the last update of a bar, and one in between only when 0.1 s and 0.5 % have passed since
    the last it sent (previews always go). The pack updates the bar at every step either way."""
    utils = Path(os.environ["COMFYUI_PATH"]) / "comfy" / "utils.py"
    return "PROGRESS_THROTTLE_MIN_INTERVAL" in utils.read_text(encoding="utf-8")


def strip_colour(text: str) -> str:
    """``text`` without terminal colour codes (newer ComfyUI colours its log: ``[INFO]`` in green)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def preview_frame(raw: bytes) -> tuple[dict, Preview] | None:
    """A binary PREVIEW_IMAGE_WITH_METADATA frame: event type, metadata length, metadata JSON, image."""
    (event,) = struct.unpack(">I", raw[:4])
    if event != PREVIEW_IMAGE_WITH_METADATA:
        return None
    (length,) = struct.unpack(">I", raw[4:8])
    metadata = json.loads(raw[8 : 8 + length])
    return metadata, Preview(metadata["node_id"], metadata["image_type"], raw[8 + length :])


def follow(
    ws, prompt_id: str, timeout: float, on_message: OnMessage | None = None
) -> tuple[list[tuple[str, dict]], list[Preview]]:
    """This prompt's messages and previews up to ``executing`` with node None (ComfyUI's "prompt done")."""
    import websocket

    messages: list[tuple[str, dict]] = []
    previews: list[Preview] = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(
                f"prompt {prompt_id} did not finish within {timeout} s; got {[m[0] for m in messages]}"
            )
        ws.settimeout(remaining)
        try:
            raw = ws.recv()
        except websocket.WebSocketTimeoutException:
            continue
        if isinstance(raw, bytes):
            frame = preview_frame(raw)
            if frame is not None and frame[0].get("prompt_id") == prompt_id:
                previews.append(frame[1])
            continue
        message = json.loads(raw)
        data = message.get("data") or {}
        if data.get("prompt_id") != prompt_id:
            continue
        messages.append((message["type"], data))
        if on_message is not None:
            on_message(message["type"], data)
        if message["type"] == "executing" and data.get("node") is None:
            return messages, previews


@contextlib.contextmanager
def running_server(
    request,
    base: Path,
    tiny_folder: Path,
    extra_args: tuple[str, ...] = (),
    sdxl_vae_file: Path | None = None,
    cpu: bool = True,
    custom_nodes: dict[str, Path] | None = None,
    pack: bool = True,
) -> Iterator[ComfyServer]:
    """A ComfyUI server on a free local port with ``base`` as its base directory (custom_nodes/ links to
    this repository — not when ``pack`` is False — and to each other node pack of ``custom_nodes``, NAME:
    folder, used in place: comfy_server.link_custom_node; models/diffusers/ holds a copy of the tiny model
    — tests change it —, models/vae/ holds ``sdxl_vae_file`` as ``SDXL_VAE_FILE`` when one is given),
    started and stopped by comfy_server.py (with --cpu unless ``cpu`` is False: then on the
    GPU, with the version's defaults such as Dynamic VRAM); its log is printed when a test of the module
    failed meanwhile."""
    import comfy_server

    for folder in ("models/diffusers", "models/vae", "models/vae_approx"):
        (base / folder).mkdir(parents=True)
    shutil.copytree(tiny_folder, base / "models" / "diffusers" / MODEL)
    if sdxl_vae_file is not None:
        shutil.copyfile(sdxl_vae_file, base / "models" / "vae" / SDXL_VAE_FILE)
    failed_before = request.session.testsfailed
    with contextlib.ExitStack() as stack:
        try:
            started = stack.enter_context(
                comfy_server.started(
                    Path(os.environ["COMFYUI_PATH"]),
                    base,
                    models={},
                    python=os.environ.get("COMFYUI_PYTHON") or sys.executable,
                    cpu=cpu,
                    # What most users set; in ComfyUI 0.8 "auto" means latent-to-RGB. A prompt's
                    # extra_data can override it (the web UI's preview setting).
                    extra_args=("--preview-method", "auto", *extra_args),
                    timeout=START_TIMEOUT,
                    custom_nodes=custom_nodes,
                    pack=pack,
                )
            )
        except comfy_server.ServerError as exc:
            pytest.fail(str(exc))
        try:
            yield ComfyServer(url=started.url, base=base, log=started.log, pid=started.pid)
        finally:
            if request.session.testsfailed > failed_before:
                capture = request.config.pluginmanager.getplugin("capturemanager")
                with capture.global_and_fixture_disabled():
                    log = started.log
                    print(f"\n----- ComfyUI server log ({log}) -----\n{log.read_text()}", file=sys.stderr)


def node_id(prompt: dict, class_type: str) -> str:
    (found,) = [key for key, node in prompt.items() if node["class_type"] == class_type]
    return found


def basic_prompt(model: str = MODEL, **sampler_inputs) -> dict:
    """The bundled API workflow on the tiny model at its native size, few steps."""
    prompt = json.loads(API_WORKFLOW.read_text(encoding="utf-8"))
    for node in prompt.values():
        if "model" in node["inputs"]:
            node["inputs"]["model"] = model
    sampler = prompt[node_id(prompt, "PixArtQ_Sampler")]["inputs"]
    sampler.update({"width": SIZE, "height": SIZE, "steps": STEPS, **sampler_inputs})
    return prompt


def free_vram_prompt() -> dict:
    """Only Free VRAM (on the encoder's output, cached after the first prompt)."""
    basic = basic_prompt()
    encoder = node_id(basic, "PixArtQ_T5Encode")
    return {
        encoder: basic[encoder],
        "free": {"class_type": "PixArtQ_FreeVRAM", "inputs": {"value": [encoder, 0]}},
    }


def new_files(folder: Path, before: set[Path], pattern: str) -> list[Path]:
    return sorted(set(folder.glob(pattern)) - before)


def wait_for_log(server, start: int, text: str, count: int, deadline_s: float = 60) -> bool:
    """Whether the server log shows ``text`` ``count`` times after ``start`` within the deadline."""
    deadline = time.monotonic() + deadline_s
    while server.log_text(start).count(text) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
