"""The bundled workflows in a real ComfyUI (the ``comfyui`` tier): every UI and API file against the
server's /object_info, every API file run through the client (``python -m pixart_lowvram queue``) on
the tiny model, and what lets several servers share the work: no state across prompts that changes
results, no fixed output paths, models named under the standard folders, two servers at once.

The module's server has the tiny model in models/diffusers, its VAE as ``sdxl_vae.safetensors`` in
models/vae (for the with-core-nodes workflow) and a random LoRA of it in models/loras under the name the
LoRA + KSampler workflow picks. Needs COMFYUI_PATH; COMFYUI_PYTHON names its interpreter.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
from comfyui_support import (
    HTTP_TIMEOUT,
    MODEL,
    PACK_LINK,
    PROMPT_TIMEOUT,
    SDXL_VAE_FILE,
    WIDGET_TYPES,
    ComfyServer,
    running_server,
    strip_colour,
)
from PIL import Image
from test_inputs import STAGES
from test_workflows import (
    ANY,
    API_FILES,
    INPUT_ORDER,
    SOCKETS,
    UI_FILES,
    VIRTUAL,
    WIDGETS,
    api_file,
    ids,
    read,
    widgets_of,
)
from tiny_workflows import LORA_SCALE, tiny_sets, tiny_size

from pixart_lowvram.cli.random_model import save_random_lora
from pixart_lowvram.core import inputs

pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)

CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
DECLARED_KINDS = {
    inputs.INT: "INT",
    inputs.FLOAT: "FLOAT",
    inputs.BOOL: "BOOLEAN",
    inputs.CHOICE: "COMBO",
    inputs.TEXT: "STRING",
}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny_folder, sdxl_vae_file):
    """This module's server also has the tiny model's VAE as models/vae/sdxl_vae.safetensors, and a random
    LoRA of the tiny model in models/loras under the name the LoRA + KSampler workflow picks."""
    base = tmp_path_factory.mktemp("comfyui")
    (lora,) = widgets_of("lora_ksampler", "LoraLoaderModelOnly")
    save_random_lora(tiny_folder, base / "models" / "loras" / lora["lora_name"], scale=LORA_SCALE)
    with running_server(request, base, tiny_folder, sdxl_vae_file=sdxl_vae_file) as started:
        yield started


# ---- the files against /object_info ------------------------------------------------------------


def declared_inputs(node_info: dict) -> list[tuple[str, object, dict]]:
    """(name, type, options) of a node's inputs in /object_info's input_order, hidden ones left out."""
    inputs = []
    for section in ("required", "optional"):
        for name in node_info["input_order"].get(section, []):
            kind, options = [*node_info["input"][section][name], {}][:2]
            inputs.append((name, kind, options))
    return inputs


def is_widget(kind: object, options: dict) -> bool:
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput")


def widget_value_fits(kind: object, options: dict, value: object) -> bool:
    if kind == "COMBO" or isinstance(kind, list):
        return isinstance(value, str)  # the model list depends on the machine
    if kind == "INT":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and options["min"] <= value <= options["max"]
        )
    if kind == "FLOAT":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and options["min"] <= value
    return isinstance(value, {"STRING": str, "BOOLEAN": bool}[kind])


def test_cpu_tier_tables_match_object_info(server):
    """test_workflows.py checks the files without ComfyUI against tables; they are the server's schemas."""
    info = server.get("/object_info")
    for kind in WIDGETS:
        inputs = declared_inputs(info[kind])
        optional = set(info[kind]["input_order"].get("optional", []))
        assert tuple(name for name, _k, _o in inputs) == INPUT_ORDER[kind], kind
        assert tuple(name for name, k, o in inputs if is_widget(k, o)) == WIDGETS[kind], kind
        sockets = [(name, k, name in optional) for name, k, o in inputs if not is_widget(k, o)]
        assert sockets == SOCKETS[kind][0], kind
        outputs = [(n, k) for n, k in zip(info[kind]["output_name"], info[kind]["output"], strict=True)]
        assert outputs_fit(kind, SOCKETS[kind][1], outputs), kind
    for kind in VIRTUAL:
        assert kind not in info, f"{kind} is a frontend-only node (left out of API prompts)"


def test_declared_inputs_match_object_info(server):
    """Every input core declares (test_inputs.py's STAGES) is the node's: its kind, default, range,
    options, optional flag and tooltip (ComfyUI's words may follow it)."""
    info = server.get("/object_info")
    for node, table in STAGES.items():
        for item in table.declared:
            section = "optional" if item.optional else "required"
            kind, options = info[node]["input"][section][item.name]
            assert kind == DECLARED_KINDS[item.kind], (node, item.name)
            assert options["default"] == item.default, (node, item.name)
            assert options["tooltip"].startswith(item.tooltip), (node, item.name)
            for key in ("min", "max", "step", "round"):
                assert options.get(key) == getattr(item, key), (node, item.name, key)
            if item.kind == inputs.CHOICE:
                assert options["options"] == item.options(), (node, item.name)
            assert options.get("multiline", False) == item.multiline, (node, item.name)
            assert options.get("control_after_generate", False) == item.control_after_generate, (
                node,
                item.name,
            )


def outputs_fit(kind: str, saved: list, declared: list) -> bool:
    """A saved node's outputs against the server's: the pack's nodes exactly; a core node's may lack
    outputs that a newer ComfyUI added after them (v0.33.0's SaveImage passes its IMAGE on), which the
    files, saved for every supported version, do not link."""
    if kind.startswith("PixArtQ_"):
        return saved == declared
    return saved == declared[: len(saved)]


@pytest.mark.parametrize("path", API_FILES, ids=ids(API_FILES))
def test_api_workflow_matches_object_info(server, path):
    info = server.get("/object_info")
    for key, entry in read(path).items():
        node_info = info[entry["class_type"]]
        optional = set(node_info["input_order"].get("optional", []))
        # An optional socket left unlinked is not in the API format.
        names = [
            name
            for name, kind, options in declared_inputs(node_info)
            if name in entry["inputs"] or name not in optional or is_widget(kind, options)
        ]
        assert list(entry["inputs"]) == names, f"API node {key} ({entry['class_type']})"
        for name, kind, options in declared_inputs(node_info):
            if is_widget(kind, options):
                value = entry["inputs"][name]
                assert widget_value_fits(kind, options, value), f"API node {key} {name}={value!r}"


@pytest.mark.parametrize("path", UI_FILES, ids=ids(UI_FILES))
def test_ui_workflow_matches_object_info(server, path):
    info = server.get("/object_info")
    ui = read(path)
    link_types = {link[0]: link[5] for link in ui["links"]}
    for node in ui["nodes"]:
        if node["type"] in VIRTUAL:
            continue
        node_info = info[node["type"]]
        inputs = declared_inputs(node_info)
        # A pass-through input and its output show the type of what is linked to the input.
        kinds = {name: kind for name, kind, _options in inputs}
        matched = {link_types[s["link"]] for s in node["inputs"] if kinds.get(s["name"]) == ANY}
        assert len(matched) <= 1, f"UI node {node['id']} links different types to one pass-through input"
        shown = {ANY: matched.pop()} if matched else {}

        sockets = [(n, shown.get(kind, kind)) for n, kind, options in inputs if not is_widget(kind, options)]
        assert [(s["name"], s["type"]) for s in node["inputs"]] == sockets, f"UI node {node['id']}"

        values = list(node["widgets_values"])
        for name, kind, options in inputs:
            if is_widget(kind, options):
                value = values.pop(0)
                assert widget_value_fits(kind, options, value), f"UI node {node['id']} {name}={value!r}"
                if options.get("control_after_generate"):
                    assert values.pop(0) in CONTROL_VALUES
        assert values == [], f"UI node {node['id']} has extra widget values"

        outputs = [(o["name"], o["type"]) for o in node["outputs"]]
        declared = zip(node_info["output_name"], node_info["output"], strict=True)
        declared = [(name, shown.get(kind, kind)) for name, kind in declared]
        assert outputs_fit(node["type"], outputs, declared), f"UI node {node['id']}: {outputs} vs {declared}"


# ---- the API files through the client ----------------------------------------------------------


def queue_args(server: ComfyServer, path: Path, out: Path, *args: str) -> list[str]:
    """``python -m pixart_lowvram queue`` for ``path`` on ``server``, as a user runs it."""
    return [
        sys.executable,
        "-m",
        "pixart_lowvram",
        "queue",
        str(path),
        "--server",
        server.url,
        "--out",
        str(out),
        *args,
    ]


def queue(server: ComfyServer, path: Path, out: Path, *args: str) -> tuple[list[str], list[Path]]:
    """Run the client to the end; the prompt ids it reports and the images it downloaded."""
    result = subprocess.run(
        queue_args(server, path, out, *args),
        capture_output=True,
        text=True,
        timeout=PROMPT_TIMEOUT,
        check=False,
        cwd=server.base,
    )
    assert result.returncode == 0, result.stderr
    return reported(result.stdout)


def reported(stdout: str) -> tuple[list[str], list[Path]]:
    prompt_ids = re.findall(r"^prompt (\S+): \d+ image\(s\)$", stdout, flags=re.M)
    files = [Path(line.strip()) for line in stdout.splitlines() if line.startswith("  ")]
    return prompt_ids, files


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def history(server: ComfyServer, prompt_id: str) -> dict:
    return server.get(f"/history/{prompt_id}")[prompt_id]


@pytest.mark.parametrize("path", API_FILES, ids=ids(API_FILES))
def test_api_workflow_runs_through_the_client(server, path, tmp_path):
    """Each bundled API workflow, set to the tiny model from the command line, runs to the end and its
    saved image comes back; Preview Image's and Memory Snapshot's outputs are in the history."""
    api = read(path)
    (prompt_id,), files = queue(server, path, tmp_path / "out", *tiny_sets(path))
    saves = [key for key, entry in api.items() if entry["class_type"] == "SaveImage"]
    assert len(files) == len(saves) == 1
    with Image.open(files[0]) as image:
        assert image.size == (tiny_size(path),) * 2
    prefix = api[saves[0]]["inputs"]["filename_prefix"]
    assert files[0].name.startswith(prefix + "_")

    outputs = history(server, prompt_id)["outputs"]
    for key, entry in api.items():
        if entry["class_type"] == "PreviewImage":
            (preview,) = outputs[key]["images"]
            assert preview["type"] == "temp"
        if entry["class_type"] == "PixArtQ_MemorySnapshot":
            snapshot_prefix = entry["inputs"]["filename_prefix"]
            assert "peak allocated" in "\n".join(outputs[key]["text"]).lower()
            assert sorted(server.output.glob(f"{snapshot_prefix}_*.json")), "the memory record is written"
        if entry["class_type"] == "PixArtQ_FreeVRAM":
            assert outputs[key]["text"], f"Free VRAM node {key} reports what it freed"


def test_core_vae_decode_equals_the_packs(server, tmp_path):
    """The with-core-nodes workflow decodes the pack's LATENT with core VAE Decode and the SDXL VAE file
    (the tiny model's VAE weights): the same picture as the pack's own VAE Decode from the same latent."""
    sets = [*tiny_sets(api_file("with_core_nodes")), "--seed=11"]
    _ids, (core,) = queue(server, api_file("with_core_nodes"), tmp_path / "core", *sets)
    _ids, (pack,) = queue(
        server, api_file("basic"), tmp_path / "pack", *tiny_sets(api_file("basic")), "--seed=11"
    )
    difference = np.abs(pixels(core).astype(int) - pixels(pack).astype(int))
    assert difference.mean() < 2.0 and np.percentile(difference, 99) <= 8, difference.max()


def test_fast_sampler_in_comfyui(server, tmp_path):
    """The sampler's fast option through a real server (inductor on the CPU): the image of the default
    path, and a next prompt (the transformer loaded again) runs on it too. That a reload compiles nothing
    is the CPU tier's (test_fast_path.py)."""
    path, sets = api_file("basic"), [*tiny_sets(api_file("basic")), "--seed=13"]
    _ids, (plain,) = queue(server, path, tmp_path / "plain", *sets)
    _ids, (fast,) = queue(server, path, tmp_path / "fast", *sets, "--set=2.fast=true")
    _ids, (again,) = queue(
        server, path, tmp_path / "again", *sets, "--set=2.fast=true", "--prompt=a blue house"
    )
    difference = np.abs(pixels(fast).astype(int) - pixels(plain).astype(int))
    assert difference.mean() < 1.0 and difference.max() <= 8, difference.max()
    assert not np.array_equal(pixels(again), pixels(fast))


# ---- what lets several servers share the work ----------------------------------------------------


def test_no_state_across_prompts_changes_results(server, tmp_path):
    """The same prompt and seed give the same image, also after a different prompt ran in between, and
    with every model kept loaded between prompts (the pack's only state across prompts)."""
    path = api_file("basic")
    kept = [f"--set={key}.keep_loaded=true" for key in ("1", "2", "3")]
    sets = [*tiny_sets(path), *kept]
    try:
        _ids, (first,) = queue(server, path, tmp_path / "a", *sets, "--seed=5")
        _ids, (other,) = queue(
            server, path, tmp_path / "b", *sets, "--seed=6", "--prompt=a blue house by the sea"
        )
        again_ids, (again,) = queue(server, path, tmp_path / "c", *sets, "--seed=5")
    finally:
        requests.post(server.url + "/free", json={"unload_models": True}, timeout=HTTP_TIMEOUT)
    assert not np.array_equal(pixels(first), pixels(other)), "a different prompt and seed change the image"
    assert np.array_equal(pixels(first), pixels(again))
    # The repeat really ran (ComfyUI's cache did not hand back the first prompt's outputs).
    cached = {
        node
        for kind, data in history(server, again_ids[0])["status"]["messages"]
        if kind == "execution_cached"
        for node in data["nodes"]
    }
    assert "2" not in cached, "the sampler ran again"


def test_outputs_are_new_files_named_from_the_prefix(server, tmp_path):
    """Two prompts of one workflow write two files, each named from its node's prefix with ComfyUI's
    counter: nothing is written to a fixed path that a second prompt (or server) would overwrite."""
    path = api_file("memory_debug")
    before = set(server.output.iterdir())
    prompt_ids, files = queue(server, path, tmp_path / "out", *tiny_sets(path), "--count=2")
    assert len(prompt_ids) == 2 and len(files) == 2 and files[0].name != files[1].name
    new = sorted(p.name for p in set(server.output.iterdir()) - before)
    images = [name for name in new if name.startswith("PixArt_debug_") and name.endswith(".png")]
    assert sorted(images) == sorted(f.name for f in files)
    for suffix in (".json", ".md"):
        records = [name for name in new if name.startswith("pixart_memory_debug_") and name.endswith(suffix)]
        assert len(records) == 2, new


def test_models_are_listed_by_name_under_the_standard_folders(server):
    """The server offers models as names relative to its model folders, the names the workflows use."""
    info = server.get("/object_info")
    for kind, name in (
        ("PixArtQ_T5Encode", "model"),
        ("PixArtQ_Sampler", "model"),
        ("VAELoader", "vae_name"),
    ):
        spec = {**info[kind]["input"]["required"], **info[kind]["input"].get("optional", {})}[name]
        options = spec[0] if isinstance(spec[0], list) else spec[1]["options"]
        expected = SDXL_VAE_FILE if kind == "VAELoader" else MODEL
        assert expected in options, options
        assert not any(str(option).startswith(("/", "~")) or ":\\" in str(option) for option in options)


SHARED_MODEL = "shared-pixart"


@pytest.fixture(scope="module")
def two_servers(request, tmp_path_factory, tiny_folder):
    """Two more servers, each with its own port and base directory, finding the model by name in one
    shared folder through --extra-model-paths-config, as one server per GPU would."""
    shared = tmp_path_factory.mktemp("shared_models")
    shutil.copytree(tiny_folder, shared / "diffusers" / SHARED_MODEL)
    config = shared / "extra_model_paths.yaml"
    config.write_text(f"shared:\n  base_path: {shared}\n  diffusers: diffusers/\n", encoding="utf-8")
    args = ("--extra-model-paths-config", str(config))
    with contextlib.ExitStack() as stack:
        started = [
            stack.enter_context(
                running_server(request, tmp_path_factory.mktemp(f"comfyui_{n}"), tiny_folder, args)
            )
            for n in ("a", "b")
        ]
        yield started


def test_two_servers_at_once_both_finish(two_servers, tmp_path):
    """The client against two servers at the same time (one per GPU, in a real setup), the model named
    from a shared folder: both finish their prompts and each image comes from its own server."""
    path = api_file("basic")
    sets = [*tiny_sets(path, SHARED_MODEL), "--count=2"]
    processes = [
        subprocess.Popen(
            queue_args(server, path, tmp_path / f"out{n}", *sets),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=server.base,
        )
        for n, server in enumerate(two_servers)
    ]
    results = [process.communicate(timeout=2 * PROMPT_TIMEOUT) for process in processes]
    for server, process, (stdout, stderr) in zip(two_servers, processes, results, strict=True):
        assert process.returncode == 0, stderr
        prompt_ids, files = reported(stdout)
        assert len(prompt_ids) == 2 and len(files) == 2
        for prompt_id in prompt_ids:
            entry = history(server, prompt_id)
            assert entry["status"]["status_str"] == "success"
        assert sorted(p.name for p in server.output.glob("PixArt_*.png")) == sorted(f.name for f in files)
        assert not (server.models / SHARED_MODEL).exists(), "the model came from the shared folder"
    # Same workflow and seeds on both: the same images, whichever server ran them.
    first, second = (sorted(tmp_path.joinpath(f"out{n}").rglob("*.png")) for n in (0, 1))
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(pixels(a), pixels(b))


# What ComfyUI (app/custom_node_manager.py, v0.3.64 to v0.33.0) says of a pack's workflows/ folder, at
# DEBUG level only: it serves the folder all the same, as it serves example_workflows/.
RENAME_NOTE = "Found example workflow folder 'workflows' for custom node '{pack}', consider renaming it"


@pytest.fixture(scope="module")
def debug_server(request, tmp_path_factory, tiny_folder):
    """A server that logs at DEBUG level, where ComfyUI notes the name of a pack's templates folder."""
    base = tmp_path_factory.mktemp("comfyui_debug")
    with running_server(request, base, tiny_folder, ("--verbose", "DEBUG")) as started:
        yield started


def test_templates_browser_lists_the_ui_workflows_with_thumbnails(debug_server):
    """ComfyUI's templates browser shows the UI workflows of workflows/ (not the API files in
    workflows/api/, which open as an empty graph there), and serves each one and its thumbnail at the
    URLs the frontend asks for."""
    server = debug_server
    listed = server.get("/workflow_templates")
    (names,) = [names for pack, names in listed.items() if pack == PACK_LINK]
    assert sorted(names) == [path.stem for path in UI_FILES]
    for path in UI_FILES:
        url = f"{server.url}/api/workflow_templates/{PACK_LINK}/{path.stem}"
        workflow = requests.get(f"{url}.json", timeout=HTTP_TIMEOUT)
        assert workflow.ok and workflow.json() == read(path)
        # The frontend (1.27.10, 1.35.9, 1.49.6: ComfyUI 0.3.64, 0.8.0, 0.33.0) asks for a pack's
        # thumbnail as <name>.jpg beside <name>.json; it knows no other name or format.
        thumbnail = requests.get(f"{url}.jpg", timeout=HTTP_TIMEOUT)
        assert thumbnail.ok and thumbnail.headers["Content-Type"].startswith("image/")
        assert thumbnail.content == path.with_suffix(".jpg").read_bytes()
    log = strip_colour(server.log_text())
    loading = [line.strip() for line in log.splitlines() if "Trying to load custom node" in line]
    assert any(line.endswith(PACK_LINK) for line in loading), "the server does not log at DEBUG level"
    # The folder ComfyUI found is workflows/, once (no second folder of workflows beside it).
    assert log.count("Found example workflow folder") == 1 and RENAME_NOTE.format(pack=PACK_LINK) in log


def test_the_folder_name_note_is_not_in_the_log_at_the_default_level(server):
    """ComfyUI's note on the workflows/ folder's name is a DEBUG line: a server at its default level
    logs nothing about the pack's workflows (no warning, no rename advice)."""
    log = strip_colour(server.log_text())
    assert "Trying to load custom node" not in log, "the server logs at DEBUG level"
    assert "consider renaming" not in log and "Found example workflow folder" not in log
