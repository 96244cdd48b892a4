"""Queue an API-format workflow on a running ComfyUI and fetch its images: ``python -m pixart_lowvram queue``.

Talks to one server only. The workflow is checked against the server's ``/object_info`` before
anything is queued; each prompt is submitted with a ``prompt_id`` made here, followed on the websocket
for progress, and judged by ``/history/<prompt_id>``, read once the websocket says the prompt is done:
ComfyUI writes the history entry between ``execution_success`` (or an error) and its closing
``executing`` message with no node, so the client waits for that one.

ComfyUI (0.8) takes the ``prompt_id`` of a POST /prompt as given and does not refuse one it has
already queued or run: a second POST with the same id queues the job again (and overwrites its
history entry). So a submit that failed on the connection is retried with the same id only after
``/queue`` and ``/history`` show that id unknown to the server. From about 0.38 it refuses an id that is
not a canonical UUID: the ids made here are (``str(uuid.uuid4())``), and one given is checked first.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath

import requests
import websocket
from tqdm import tqdm

from ..core.contract import check_each, check_size

logger = logging.getLogger(__name__)

DEFAULT_SERVER = "http://127.0.0.1:8188"
# What a refused connection says to do: most often no ComfyUI runs there yet.
START_HINT = (
    "Is ComfyUI running there? Start it in its folder with `python main.py` (it listens on 127.0.0.1:8188; "
    "--listen and --port change that), or give the address of a running one with --server."
)
# Node inputs renamed since workflows were saved with them: class_type -> {old name: name}, and values of a
# choice renamed: (class_type, input) -> {old value: value}. Applied when a workflow is loaded.
RENAMED_INPUTS = {"PixArtQ_Sampler": {"weights": "quantization"}}
RENAMED_VALUES = {("PixArtQ_VAEDecode", "vae_file"): {"(model folder)": "(from model)"}}
HTTP_TIMEOUT = (5.0, 30.0)  # seconds: connect, read
SUBMIT_ATTEMPTS = 3
RETRY_PAUSE = 2.0  # seconds; lets a request that did reach the server land in its queue first
POLL = 2.0  # seconds between /history checks while the websocket is quiet
T5_ENCODE = "PixArtQ_T5Encode"
ENDED = ("execution_success", "execution_error", "execution_interrupted")
# Seconds to wait after one of ENDED for the closing ``executing`` message (sent once the history is written;
# every ComfyUI sends it to the prompt's client) before reading /history anyway.
CLOSING_GRACE = 1.0
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
SIZE = re.compile(r"(\d+)\s*[x×]\s*(\d+)", re.IGNORECASE)  # --size WxH
CUSTOM_SIZE = "custom"  # the sampler's resolution choice that takes its width and height


class ClientError(RuntimeError):
    """Something the user can fix or the server refused; the message says which."""


# ---- the workflow, without a server ----------------------------------------------------------


def load_workflow(path: Path) -> dict:
    try:
        workflow = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ClientError(f"{path} is not JSON: {exc}") from exc
    except OSError as exc:
        raise ClientError(
            f"the workflow {path} cannot be read ({exc.strerror or exc}); give an API-format workflow file, "
            "e.g. workflows/api/pixart_lowvram_basic_api.json"
        ) from exc
    if isinstance(workflow, dict) and "nodes" in workflow and "links" in workflow:
        raise ClientError(
            f"{path} is a UI-format workflow; queue the API format "
            "(ComfyUI: Workflow > Export (API), or the *_api.json files in workflows/api/)"
        )
    if not isinstance(workflow, dict) or not all(
        isinstance(node, dict) and "class_type" in node for node in workflow.values()
    ):
        raise ClientError(f"{path} is not an API-format workflow (a dict of node id -> class_type, inputs)")
    return upgrade(workflow)


def upgrade(workflow: dict) -> dict:
    """``workflow`` with the pack's renamed inputs and choices under their current names (in place)."""
    for node in workflow.values():
        inputs = node.get("inputs", {})
        for old, new in RENAMED_INPUTS.get(node["class_type"], {}).items():
            if old in inputs and new not in inputs:
                inputs[new] = inputs.pop(old)
        for name, value in list(inputs.items()):
            renamed = RENAMED_VALUES.get((node["class_type"], name), {})
            if isinstance(value, str) and value in renamed:
                inputs[name] = renamed[value]
    return workflow


def _convert(text: str, current: object, where: str) -> object:
    """``text`` as the type of the input's current value."""
    if isinstance(current, list):
        raise ClientError(f"{where} is linked to node {current[0]!r}; --set sets widget values only")
    try:
        if isinstance(current, bool):
            if text.lower() not in TRUE + FALSE:
                raise ValueError
            return text.lower() in TRUE
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}[type(current)]
        raise ClientError(f"{where}: {text!r} is not {kind} (the current value is {current!r})") from None
    if isinstance(current, str):
        return text
    raise ClientError(f"{where} holds {current!r}; --set handles int, float, bool and str inputs")


def set_input(workflow: dict, assignment: str) -> None:
    """Apply one ``NODE.INPUT=VALUE`` to ``workflow`` in place, keeping the input's type."""
    target, sep, text = assignment.partition("=")
    node, dot, name = target.rpartition(".")
    if not sep or not dot or not node or not name:
        raise ClientError(f"--set {assignment!r}: expected NODE.INPUT=VALUE, e.g. 2.steps=30")
    if node not in workflow:
        raise ClientError(
            f"--set {assignment!r}: no node {node!r}; the workflow's nodes: {', '.join(workflow)}"
        )
    inputs = workflow[node].setdefault("inputs", {})
    where = f"node {node} ({workflow[node]['class_type']}) input {name!r}"
    if name not in inputs:
        raise ClientError(f"--set {assignment!r}: {where} does not exist; its inputs: {', '.join(inputs)}")
    inputs[name] = _convert(text, inputs[name], where)


def parse_size(text: str) -> tuple[int, int]:
    """``--size WxH`` as (width, height) in pixels."""
    match = SIZE.fullmatch(text.strip())
    if match is None:
        raise ClientError(f"--size {text!r}: expected WIDTHxHEIGHT in pixels, e.g. 768x1344")
    width, height = int(match.group(1)), int(match.group(2))
    if not width or not height:
        raise ClientError(f"--size {text!r}: width and height must be above 0, e.g. 768x1344")
    try:
        check_each(partial(check_size, "width", width), partial(check_size, "height", height))
    except ValueError as exc:
        raise ClientError(f"--size {text!r}: {exc}") from None
    return width, height


def _widget(inputs: dict, name: str, kind: type) -> bool:
    """Whether ``inputs[name]`` is a widget value of ``kind`` (not a link, not missing)."""
    value = inputs.get(name)
    return isinstance(value, kind) and not isinstance(value, bool)


def set_model(workflow: dict, model: str) -> None:
    """``--model``: every ``model`` input that is a widget value (a name, not a link) set to ``model``."""
    nodes = [node for node in workflow.values() if _widget(node.get("inputs", {}), "model", str)]
    if not nodes:
        raise ClientError(
            "--model: the workflow has no node with a model name (a model input that is not a link)"
        )
    for node in nodes:
        node["inputs"]["model"] = model


def set_size(workflow: dict, width: int, height: int) -> None:
    """``--size``: the width and height of every node that has both as numbers; a node with a ``resolution``
    choice (the sampler) gets ``custom``, the choice that takes them."""
    nodes = [
        node
        for node in workflow.values()
        if _widget(node.get("inputs", {}), "width", int) and _widget(node.get("inputs", {}), "height", int)
    ]
    if not nodes:
        raise ClientError(
            "--size: the workflow has no node with width and height inputs (numbers, not links)"
        )
    for node in nodes:
        inputs = node["inputs"]
        inputs["width"], inputs["height"] = width, height
        if _widget(inputs, "resolution", str):
            inputs["resolution"] = CUSTOM_SIZE


def seed_inputs(workflow: dict) -> list[tuple[str, str]]:
    """(node id, input name) of every ``seed`` input that holds a number (not a link)."""
    return [
        (key, "seed")
        for key, node in workflow.items()
        if isinstance(node.get("inputs", {}).get("seed"), int)
        and not isinstance(node["inputs"]["seed"], bool)
    ]


def apply_overrides(
    workflow: dict,
    sets: Iterable[str] = (),
    prompt: str | None = None,
    seed: int | None = None,
    model: str | None = None,
    size: tuple[int, int] | None = None,
) -> dict:
    """A copy of ``workflow`` with ``--model`` and ``--size``, then the ``--set`` assignments (which so
    override them on one node), ``--prompt`` and ``--seed`` applied."""
    workflow = copy.deepcopy(workflow)
    if model is not None:
        set_model(workflow, model)
    if size is not None:
        set_size(workflow, *size)
    for assignment in sets:
        set_input(workflow, assignment)
    if prompt is not None:
        encoders = [node for node in workflow.values() if node["class_type"] == T5_ENCODE]
        if not encoders:
            raise ClientError(f"--prompt: the workflow has no {T5_ENCODE} node")
        for node in encoders:
            node["inputs"]["prompt"] = prompt
    if seed is not None:
        targets = seed_inputs(workflow)
        if not targets:
            raise ClientError("--seed: the workflow has no node with a seed input")
        for key, name in targets:
            workflow[key]["inputs"][name] = seed
    return workflow


def expand(workflow: dict, count: int) -> list[dict]:
    """``count`` copies of ``workflow``, every seed input incremented by one per copy."""
    if count < 1:
        raise ClientError(f"--count {count}: must be 1 or more")
    prompts = []
    for index in range(count):
        copied = copy.deepcopy(workflow)
        for key, name in seed_inputs(copied):
            copied[key]["inputs"][name] += index
        prompts.append(copied)
    return prompts


def _combo_options(spec: object) -> list | None:
    """The allowed values of an /object_info input spec, or None when it is not a combo."""
    if not isinstance(spec, list) or not spec:
        return None
    kind, options = spec[0], spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if isinstance(kind, list):
        return kind
    if kind == "COMBO":
        return list(options.get("options", []))
    return None


def check_workflow(workflow: dict, object_info: dict) -> list[str]:
    """What the server lacks for ``workflow``: node types it does not have, and combo values (models,
    files, choices) not in its option lists. Empty when the workflow can be queued."""
    problems = []
    for key, node in workflow.items():
        class_type = node["class_type"]
        info = object_info.get(class_type)
        if info is None:
            problems.append(
                f"node {key}: the server has no node type {class_type!r} "
                "(is the pack, or the pack that provides it, installed in its custom_nodes?)"
            )
            continue
        declared = {**info.get("input", {}).get("required", {}), **info.get("input", {}).get("optional", {})}
        for name, value in node.get("inputs", {}).items():
            options = _combo_options(declared.get(name))
            if options is None or isinstance(value, list) or value in options:
                continue
            available = ", ".join(map(str, options)) or "(none)"
            problems.append(
                f"node {key} ({class_type}) input {name!r}: {value!r} is not on the server; "
                f"available: {available}"
            )
    return problems


# ---- the server --------------------------------------------------------------------------------


@dataclass
class Outcome:
    prompt_id: str
    files: list[Path]
    entry: dict = field(default_factory=dict)  # the prompt's /history entry


class Client:
    """One ComfyUI server at ``url``; every request has bounded connect/read timeouts."""

    def __init__(self, url: str = DEFAULT_SERVER, timeout: tuple[float, float] = HTTP_TIMEOUT) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex
        self.session = requests.Session()

    def _request(self, method: str, path: str, **kwargs) -> requests.Response:
        try:
            return self.session.request(method, self.url + path, timeout=self.timeout, **kwargs)
        except requests.ConnectionError as exc:
            raise ClientError(
                f"could not reach ComfyUI at {self.url} ({method} {path}): {exc}. {START_HINT}"
            ) from exc
        except requests.RequestException as exc:
            raise ClientError(f"could not reach ComfyUI at {self.url} ({method} {path}): {exc}") from exc

    def get(self, path: str, **params) -> dict:
        response = self._request("GET", path, params=params or None)
        if not response.ok:
            raise ClientError(f"ComfyUI GET {path} answered {response.status_code}: {response.text[:2000]}")
        return response.json()

    def check(self, workflow: dict) -> None:
        problems = check_workflow(workflow, self.get("/object_info"))
        if any(" input 'model': " in problem for problem in problems):
            problems.append("(--model NAME sets the model of every node that names one)")
        if problems:
            raise ClientError(
                f"the workflow cannot run on {self.url}:\n" + "\n".join(f"  {p}" for p in problems)
            )

    def knows(self, prompt_id: str) -> bool:
        """Whether the server has ``prompt_id`` running, pending or in its history."""
        queue = self.get("/queue")
        items = queue.get("queue_running", []) + queue.get("queue_pending", [])
        return any(item[1] == prompt_id for item in items) or prompt_id in self.get(f"/history/{prompt_id}")

    def submit(self, workflow: dict, prompt_id: str) -> None:
        """POST /prompt with ``prompt_id``; after a connection failure, submit again (same id) only once
        the server has answered that it does not have it."""
        body = {"prompt": workflow, "client_id": self.client_id, "prompt_id": prompt_id}
        failure: Exception | None = None
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            if failure is not None:
                time.sleep(RETRY_PAUSE)
                try:
                    if self.knows(prompt_id):
                        logger.info("prompt %s reached the server; not submitting it again", prompt_id)
                        return
                except ClientError as exc:
                    failure = exc  # whether it landed is unknown: do not post it again blind
                    continue
            try:
                response = self.session.post(self.url + "/prompt", json=body, timeout=self.timeout)
                break
            except (requests.ConnectionError, requests.Timeout) as exc:
                logger.warning("POST /prompt failed (attempt %d of %d): %s", attempt, SUBMIT_ATTEMPTS, exc)
                failure = exc
        else:
            raise ClientError(f"could not queue the prompt on {self.url}: {failure}")
        if response.status_code == 400:
            raise ClientError(refusal_text(response))
        if not response.ok:
            raise ClientError(f"ComfyUI POST /prompt answered {response.status_code}: {response.text[:2000]}")

    def connect(self) -> websocket.WebSocket | None:
        """The websocket for progress messages, or None (progress is then read from /history alone)."""
        ws_url = self.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        try:
            return websocket.create_connection(
                f"{ws_url}/ws?clientId={self.client_id}", timeout=self.timeout[0]
            )
        except (OSError, websocket.WebSocketException) as exc:
            logger.warning("no websocket at %s (%s); following the prompt through /history", ws_url, exc)
            return None

    def wait(
        self,
        ws: websocket.WebSocket | None,
        prompt_id: str,
        timeout: float,
        label: str | None,
        on_message: Callable[[str, dict], None] | None = None,
    ) -> dict:
        """Follow ``prompt_id`` until /history has it; return its history entry. ``label`` names the
        progress bar (None: no bar); ``on_message(kind, data)`` sees each of the prompt's messages."""
        deadline = time.monotonic() + timeout
        with tqdm(desc=label, unit="step", leave=True, disable=label is None) as bar:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClientError(
                        f"prompt {prompt_id} did not finish within {timeout:g} s (--timeout); it may still "
                        f"be queued or running on {self.url}"
                    )
                done = False
                if ws is not None:
                    try:
                        done = self._read(ws, prompt_id, min(remaining, POLL), bar, on_message)
                    except websocket.WebSocketTimeoutException:
                        pass
                    except (OSError, websocket.WebSocketException) as exc:
                        logger.warning("websocket closed (%s); following the prompt through /history", exc)
                        ws = None
                else:
                    time.sleep(min(remaining, POLL))
                history = self.get(f"/history/{prompt_id}")
                if prompt_id in history:
                    if ws is not None and not done:
                        # The entry is written just before the closing message is sent: a read window that
                        # ended in between leaves that message (and any before it) for ``on_message``.
                        self._read_closing(ws, prompt_id, bar, on_message)
                    return history[prompt_id]
                if done:  # no closing message came: the entry is on its way
                    time.sleep(0.1)

    @classmethod
    def _read_closing(
        cls,
        ws: websocket.WebSocket,
        prompt_id: str,
        bar: tqdm,
        on_message: Callable[[str, dict], None] | None,
    ) -> None:
        """The prompt's messages still on their way once its history entry is there, up to its closing one
        or :data:`CLOSING_GRACE` seconds."""
        with contextlib.suppress(OSError, websocket.WebSocketException):  # quiet, or closed: the entry counts
            cls._read(ws, prompt_id, CLOSING_GRACE, bar, on_message)

    @staticmethod
    def _read(
        ws: websocket.WebSocket,
        prompt_id: str,
        timeout: float,
        bar: tqdm,
        on_message: Callable[[str, dict], None] | None = None,
    ) -> bool:
        """Read messages for up to ``timeout`` seconds; True once the prompt has ended and its history entry
        is written (the closing ``executing`` message), or :data:`CLOSING_GRACE` after it reported its end
        without one."""
        end = time.monotonic() + timeout
        ended = False
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return ended
            ws.settimeout(left)
            try:
                raw = ws.recv()
            except websocket.WebSocketTimeoutException:
                if ended:
                    return True
                raise
            if isinstance(raw, bytes):  # a preview image
                continue
            message = json.loads(raw)
            kind, data = message.get("type"), message.get("data") or {}
            if data.get("prompt_id") != prompt_id:
                continue
            if on_message is not None:
                on_message(kind, data)
            if kind == "progress":
                bar.total = data.get("max")
                bar.n = data.get("value", 0)
                bar.set_postfix_str(f"node {data.get('node')}", refresh=False)
                bar.refresh()
            elif kind == "executing" and data.get("node") is None:
                return True
            elif kind in ENDED and not ended:
                ended, end = True, min(end, time.monotonic() + CLOSING_GRACE)

    def run(
        self,
        ws: websocket.WebSocket | None,
        prompt: dict,
        out: Path,
        timeout: float,
        label: str | None,
        on_message: Callable[[str, dict], None] | None = None,
        prompt_id: str | None = None,
    ) -> Outcome:
        """Submit one prompt (as ``prompt_id``, or a new id), follow it (:meth:`wait`) and download its images
        into ``out``; a prompt that did not succeed raises with the server's account of it."""
        prompt_id = check_prompt_id(prompt_id) if prompt_id else new_prompt_id()
        self.submit(prompt, prompt_id)
        entry = self.wait(ws, prompt_id, timeout, label, on_message)
        status = entry.get("status") or {}
        if status.get("status_str") != "success" or not status.get("completed"):
            raise ClientError(failure_text(prompt_id, entry))
        return Outcome(prompt_id, self.download(entry, Path(out)), entry)

    def download(self, entry: dict, out: Path) -> list[Path]:
        """Every output image of a history entry, into ``out`` (keeping ComfyUI's subfolder)."""
        files = []
        for node_output in entry.get("outputs", {}).values():
            for image in node_output.get("images", []):
                if image.get("type") != "output":
                    continue  # temp previews (Preview Image) are not results
                subfolder = PurePosixPath(image.get("subfolder") or "")
                name = PurePosixPath(image["filename"])
                if ".." in subfolder.parts or subfolder.is_absolute() or len(name.parts) != 1:
                    raise ClientError(f"refusing the server's output path {subfolder / name}")
                params = {"filename": name.name, "subfolder": image.get("subfolder") or "", "type": "output"}
                response = self._request("GET", "/view", params=params)
                if not response.ok:
                    raise ClientError(f"GET /view {params} answered {response.status_code}: {response.text}")
                path = out.joinpath(*subfolder.parts, name.name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(response.content)
                files.append(path)
        return files


def new_prompt_id() -> str:
    """A prompt id as every ComfyUI takes it: a canonical UUID (lowercase, hyphenated)."""
    return str(uuid.uuid4())


def check_prompt_id(prompt_id: str) -> str:
    """``prompt_id`` if it is a canonical UUID; ComfyUI refuses any other since about 0.38."""
    try:
        canonical = str(uuid.UUID(prompt_id))
    except (ValueError, TypeError, AttributeError):
        canonical = None
    if canonical != prompt_id:
        raise ClientError(
            f"prompt id {prompt_id!r} is not a canonical UUID, which ComfyUI's /prompt requires: give one as "
            f"str(uuid.uuid4()) writes it, e.g. {new_prompt_id()}"
        )
    return prompt_id


def refusal_text(response: requests.Response) -> str:
    """A 400 from POST /prompt as text: the error, and each node's errors."""
    try:
        body = response.json()
    except ValueError:
        return f"ComfyUI refused the prompt: {response.text[:2000]}"
    error = body.get("error") or {}
    lines = [f"ComfyUI refused the prompt: {error.get('message', '')} {error.get('details', '')}".rstrip()]
    for key, node in (body.get("node_errors") or {}).items():
        for item in node.get("errors", []):
            lines.append(
                f"  node {key} ({node.get('class_type')}): {item.get('message')}: {item.get('details')}"
            )
    return "\n".join(lines)


def failure_text(prompt_id: str, entry: dict) -> str:
    """Why a prompt did not succeed, from its history entry's status messages."""
    status = entry.get("status") or {}
    for kind, data in status.get("messages", []):
        if kind == "execution_error":
            return (
                f"prompt {prompt_id} failed in node {data.get('node_id')} ({data.get('node_type')}): "
                f"{data.get('exception_type')}: {data.get('exception_message')}"
            )
        if kind == "execution_interrupted":
            return (
                f"prompt {prompt_id} was interrupted in node {data.get('node_id')} ({data.get('node_type')})"
            )
    return f"prompt {prompt_id} ended with status {status.get('status_str')!r}"


def queue(
    workflow: dict,
    server: str = DEFAULT_SERVER,
    count: int = 1,
    out: Path = Path("out"),
    timeout: float = 600.0,
) -> list[Outcome]:
    """Check ``workflow`` against the server, then queue it ``count`` times (seeds incremented), one
    after another, downloading each prompt's images into ``out``."""
    prompts = expand(workflow, count)
    client = Client(server)
    client.check(workflow)
    ws = client.connect()
    try:
        return [
            client.run(ws, prompt, out, timeout, f"prompt {index}/{len(prompts)}")
            for index, prompt in enumerate(prompts, 1)
        ]
    finally:
        if ws is not None:
            ws.close()
