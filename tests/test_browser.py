"""The UI workflows in ComfyUI's own web page, in a real browser (the ``comfyui`` tier): each file dropped
onto the canvas as a drag from the file manager does (a drop event whose DataTransfer holds the file)
loads every node with its widget values and no "missing nodes" dialog, the page turns it into the same
prompt as the API file, and queued from the page it runs on the tiny model.

Needs COMFYUI_PATH, the ``playwright`` package and a Chromium on this machine (``chromium`` on the PATH,
or its path in CHROMIUM); skipped without them. Playwright drives the system browser: nothing is
downloaded (no ``playwright install``).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import requests
from comfyui_support import HTTP_TIMEOUT, MODEL, PROMPT_TIMEOUT, SIZE, STEPS, ComfyServer, running_server
from test_workflows import UI_FILES, VIRTUAL, ids, read, widgets_of
from tiny_workflows import KSAMPLER_SIZE

from pixart_lowvram.cli.random_model import save_random_lora

pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium on this machine (install it, or name it in CHROMIUM)", allow_module_level=True)
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="pip install playwright (no browser download needed)"
)

PAGE_TIMEOUT = 120_000  # ms; the first load of the frontend on a small CPU machine is slow

# A drag from the file manager ends in these events on the canvas, the drop's DataTransfer holding the file.
DROP = """([name, text]) => {
  const transfer = new DataTransfer();
  transfer.items.add(new File([text], name, {type: 'application/json'}));
  const canvas = app.canvasEl;
  const box = canvas.getBoundingClientRect();
  const at = {clientX: box.x + box.width / 2, clientY: box.y + box.height / 2};
  for (const type of ['dragenter', 'dragover', 'drop']) {
    canvas.dispatchEvent(new DragEvent(type, {bubbles: true, cancelable: true, dataTransfer: transfer, ...at}));
  }
}"""
# Where the page reports a load's problems (missing nodes, missing models, an invalid workflow): a modal
# dialog up to frontend 1.3x (ComfyUI 0.8); from 1.4x (ComfyUI 0.33) a missing node is no dialog but the
# error overlay in the canvas's corner ("Missing node: NAME", a "View details" button to the errors panel).
REPORTS = ".p-dialog, [data-testid='error-overlay']"
# What the page holds once a workflow is loaded: the graph as the frontend saves it, the prompt it would
# queue, the reports it shows (REPORTS), nodes it marks as broken, and whether each node's box fits its
# widgets.
STATE = """async (reports) => {
  const graph = app.graph.serialize();
  const prompt = (await app.graphToPrompt()).output;
  const dialogs = [...document.querySelectorAll(reports)].map(d => d.innerText.slice(0, 500));
  const broken = app.graph.nodes.filter(n => n.has_errors).map(n => n.type);
  const cramped = app.graph.nodes.filter(n => !n.isVirtualNode && n.size[1] + 1 < n.computeSize()[1])
    .map(n => [n.id, n.size, n.computeSize()]);
  return {graph, prompt, dialogs, broken, cramped};
}"""
# Put the loaded graph on the tiny model at its native size (an Empty Latent Image for core's KSampler:
# latent_size), few steps, through the widgets.
TINY = """([model, size, steps, latentSize]) => {
  const set = {model, width: size, height: size, steps};
  for (const node of app.graph.nodes) {
    const sized = node.type === 'EmptyLatentImage' ? {width: latentSize, height: latentSize} : {};
    for (const widget of node.widgets || []) {
      if (widget.name in sized) widget.value = sized[widget.name];
      else if (widget.name in set) widget.value = set[widget.name];
    }
  }
}"""
# The settings of a user who has opened the page before, stored on the server before the page loads.
RETURNING_USER = {
    # A new user's first visit opens the templates browser; this one has seen it.
    "Comfy.TutorialCompleted": True,
    # The canvas navigation every frontend defaults to, stored. Frontend 1.27 (ComfyUI 0.3.64), as it
    # registers Comfy.Canvas.NavigationMode at start, sets the two settings that mode implies before they
    # are registered, and throws "Cannot read properties of undefined (reading 'id')" on every page load
    # where they are not stored yet (later frontends skip that at registration); stored, nothing is set.
    "Comfy.Canvas.NavigationMode": "legacy",
    "Comfy.Canvas.LeftMouseClickBehavior": "panning",
    "Comfy.Canvas.MouseWheelScroll": "zoom",
}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny_folder, sdxl_vae_file):
    """This module's server also has the tiny model's VAE as models/vae/sdxl_vae.safetensors, and a random
    LoRA of the tiny model in models/loras under the name the LoRA + KSampler workflow picks."""
    base = tmp_path_factory.mktemp("comfyui")
    (lora,) = widgets_of("lora_ksampler", "LoraLoaderModelOnly")
    save_random_lora(tiny_folder, base / "models" / "loras" / lora["lora_name"], scale=0.15)
    with running_server(request, base, tiny_folder, sdxl_vae_file=sdxl_vae_file) as started:
        yield started


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser, server):
    """ComfyUI's page, its app and node definitions loaded; the console's errors collected."""
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    opened = context.new_page()
    opened.errors = []
    opened.on("pageerror", lambda error: opened.errors.append(str(error)))
    requests.post(server.url + "/settings", json=RETURNING_USER, timeout=HTTP_TIMEOUT).raise_for_status()
    opened.goto(server.url, timeout=PAGE_TIMEOUT)
    opened.wait_for_function(
        "window.app && app.graph && app.canvasEl && 'PixArtQ_Sampler' in LiteGraph.registered_node_types",
        timeout=PAGE_TIMEOUT,
    )
    yield opened
    context.close()


def drop(page, name: str, workflow: dict) -> dict:
    page.evaluate(DROP, [name, json.dumps(workflow)])
    page.wait_for_function(f"app.graph.nodes.length === {len(workflow['nodes'])}", timeout=PAGE_TIMEOUT)
    page.wait_for_timeout(500)  # let a dialog the load may open appear
    return page.evaluate(STATE, REPORTS)


def graph_of(prompt: dict) -> dict:
    return {key: (entry["class_type"], entry["inputs"]) for key, entry in prompt.items()}


@pytest.mark.parametrize("path", UI_FILES, ids=ids(UI_FILES))
def test_dropped_workflow_loads_and_becomes_the_api_prompt(page, path):
    workflow = read(path)
    state = drop(page, path.name, workflow)
    assert state["dialogs"] == [], "no dialog or error overlay (missing nodes, invalid workflow) opened"
    assert state["broken"] == []
    assert state["cramped"] == [], "every node is tall enough for its widgets"
    loaded = {node["id"]: node for node in state["graph"]["nodes"]}
    for node in workflow["nodes"]:
        assert loaded[node["id"]]["type"] == node["type"]
        # The frontend of ComfyUI 0.33.0 leaves out an empty widgets_values (Free VRAM has no widgets).
        assert loaded[node["id"]].get("widgets_values", []) == node["widgets_values"], f"node {node['id']}"
        assert loaded[node["id"]]["pos"] == node["pos"]
    api = read(path.parent / "api" / (path.stem + "_api.json"))
    assert graph_of(state["prompt"]) == graph_of(api)
    assert all(entry["class_type"] not in VIRTUAL for entry in state["prompt"].values())
    assert page.errors == []


def test_a_missing_node_is_reported_by_the_page(page):
    """The check above can fail: a workflow naming a node type the server lacks opens the dialog (the error
    overlay in newer frontends), in the time drop() gives it."""
    workflow = read(UI_FILES[0])
    workflow["nodes"][-1] = {**workflow["nodes"][-1], "type": "NoSuchNode"}
    state = drop(page, "broken.json", workflow)
    # "Some Nodes Are Missing" (frontend 1.27), "This workflow has missing nodes" (1.35), "Missing node:
    # NoSuchNode" (1.49)
    reported = [
        dialog for dialog in state["dialogs"] if "missing" in dialog.lower() and "NoSuchNode" in dialog
    ]
    assert reported, state["dialogs"]
    assert state["broken"] == ["NoSuchNode"]


def wait_for_new_entry(server: ComfyServer, before: set[str]) -> dict:
    deadline = time.monotonic() + PROMPT_TIMEOUT
    while time.monotonic() < deadline:
        history = server.get("/history")
        new = [history[key] for key in set(history) - before]
        if new and new[0]["status"].get("completed") is not None:
            return new[0]
        time.sleep(1)
    pytest.fail(f"no prompt from the page finished within {PROMPT_TIMEOUT} s")


@pytest.mark.parametrize("path", UI_FILES, ids=ids(UI_FILES))
def test_dropped_workflow_runs_when_queued_from_the_page(page, server, path):
    """Dropped, set to the tiny model through its widgets and queued with the page's own Queue: the
    prompt runs to the end and its images are in the history."""
    workflow = read(path)
    drop(page, path.name, workflow)
    page.evaluate(TINY, [MODEL, SIZE, STEPS, KSAMPLER_SIZE])
    before = set(server.get("/history"))
    page.evaluate("() => app.queuePrompt(0, 1)")
    entry = wait_for_new_entry(server, before)
    assert entry["status"]["status_str"] == "success", entry["status"]["messages"]
    images = [image for output in entry["outputs"].values() for image in output.get("images", [])]
    saves = [node for node in workflow["nodes"] if node["type"] == "SaveImage"]
    assert len([image for image in images if image["type"] == "output"]) == len(saves) == 1
    assert page.errors == []
