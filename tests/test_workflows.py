"""The bundled workflows: every UI (drag-and-drop) file is a consistent, type-correct litegraph graph of
known nodes with its widget values in the nodes' input order, every API (queueing) file names known
inputs and links, each UI/API pair describes the same graph, and each UI file has its thumbnail.

The nodes' schemas need ComfyUI (comfy_api) to build, so this tier keeps them as tables below; the
comfyui tier (test_comfyui_workflows.py) checks the tables and every workflow against a real server's
/object_info.
"""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest
from PIL import Image

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"

# Each node type's widget inputs in /object_info's input_order; the frontend stores their values in
# this order. Inputs that take a link are sockets, not widgets.
WIDGETS = {
    "PixArtQ_T5Encode": (
        "model",
        "prompt",
        "negative_prompt",
        "quantization",
        "keep_loaded",
        "t5_file",
        "low_vram",
    ),
    "PixArtQ_Sampler": (
        "model",
        "width",
        "height",
        "steps",
        "cfg",
        "seed",
        "batch_size",
        "quantization",
        "keep_loaded",
        "resolution",
        "scheduler",
        "denoise",
        "low_vram",
        "transformer_file",
        "fast",
        "step_cache",
        "compute",
    ),
    "PixArtQ_VAEDecode": ("model", "keep_loaded", "tiling", "vae_file"),
    "PixArtQ_FreeVRAM": (),
    "PixArtQ_MemorySnapshot": ("filename_prefix", "allocator_history"),
    "PixArtQ_ModelLoader": ("model", "quantization", "transformer_file", "compute", "keep_loaded"),
    "PixArtQ_LoRA": ("lora_name", "strength"),
    "PixArtQ_BatchedGuidance": (),
    "SaveImage": ("filename_prefix",),
    "PreviewImage": (),
    "VAELoader": ("vae_name",),
    "VAEDecode": (),
    "LoraLoaderModelOnly": ("lora_name", "strength_model"),
    "EmptyLatentImage": ("width", "height", "batch_size"),
    "KSampler": ("seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"),
}
# Each node type's sockets: inputs (name, type, optional) and outputs (name, type). ANY is a pass-through
# socket (ComfyUI's "*"): it takes any type, and the node's ANY output has the type linked to its input.
ANY = "*"
SOCKETS = {
    "PixArtQ_T5Encode": (
        [],
        [("embeds", "PIXART_EMBEDS"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING")],
    ),
    "PixArtQ_Sampler": (
        [("embeds", "PIXART_EMBEDS", False), ("latent", "LATENT", True), ("loras", "PIXART_LORAS", True)],
        [("LATENT", "LATENT")],
    ),
    "PixArtQ_VAEDecode": ([("latent", "LATENT", False)], [("IMAGE", "IMAGE")]),
    "PixArtQ_FreeVRAM": ([("value", ANY, False)], [("value", ANY)]),
    "PixArtQ_MemorySnapshot": ([("value", ANY, False)], [("value", ANY), ("timeline", "IMAGE")]),
    "PixArtQ_ModelLoader": ([], [("MODEL", "MODEL")]),
    "PixArtQ_LoRA": ([("loras", "PIXART_LORAS", True)], [("PIXART_LORAS", "PIXART_LORAS")]),
    "PixArtQ_BatchedGuidance": ([("model", "MODEL", False)], [("MODEL", "MODEL")]),
    "SaveImage": ([("images", "IMAGE", False)], []),
    "PreviewImage": ([("images", "IMAGE", False)], []),
    "VAELoader": ([], [("VAE", "VAE")]),
    "VAEDecode": ([("samples", "LATENT", False), ("vae", "VAE", False)], [("IMAGE", "IMAGE")]),
    "LoraLoaderModelOnly": ([("model", "MODEL", False)], [("MODEL", "MODEL")]),
    "EmptyLatentImage": ([], [("LATENT", "LATENT")]),
    "KSampler": (
        [
            ("model", "MODEL", False),
            ("positive", "CONDITIONING", False),
            ("negative", "CONDITIONING", False),
            ("latent_image", "LATENT", False),
        ],
        [("LATENT", "LATENT")],
    ),
}
# The order of every input (sockets and widgets) in /object_info's input_order: the API format's order.
INPUT_ORDER = {
    "PixArtQ_T5Encode": WIDGETS["PixArtQ_T5Encode"],
    "PixArtQ_Sampler": (
        "model",
        "embeds",
        *WIDGETS["PixArtQ_Sampler"][1:9],
        "latent",
        *WIDGETS["PixArtQ_Sampler"][9:-2],
        "loras",
        "step_cache",
        "compute",
    ),
    "PixArtQ_VAEDecode": ("model", "latent", "keep_loaded", "tiling", "vae_file"),
    "PixArtQ_FreeVRAM": ("value",),
    "PixArtQ_MemorySnapshot": ("value", "filename_prefix", "allocator_history"),
    "PixArtQ_ModelLoader": WIDGETS["PixArtQ_ModelLoader"],
    "PixArtQ_LoRA": ("lora_name", "strength", "loras"),
    "PixArtQ_BatchedGuidance": ("model",),
    "SaveImage": ("images", "filename_prefix"),
    "PreviewImage": ("images",),
    "VAELoader": ("vae_name",),
    "VAEDecode": ("samples", "vae"),
    "LoraLoaderModelOnly": ("model", "lora_name", "strength_model"),
    "EmptyLatentImage": WIDGETS["EmptyLatentImage"],
    "KSampler": (
        "model",
        *WIDGETS["KSampler"][:5],
        "positive",
        "negative",
        "latent_image",
        WIDGETS["KSampler"][5],
    ),
}
# Frontend-only nodes: drawn on the canvas, left out of the API format.
VIRTUAL = {"MarkdownNote": ("text",), "Note": ("text",)}
# Inputs that name a model file or folder: a name under one of ComfyUI's model folders, never a path.
MODEL_INPUTS = {"model", "t5_file", "transformer_file", "vae_file", "vae_name", "lora_name"}
# The frontend draws optional inputs with this shape (a hollow circle); only they may be left unlinked.
OPTIONAL_SHAPE = 7
# Widgets the frontend follows with a "control after generate" value of its own.
CONTROLLED = {("PixArtQ_Sampler", "seed"), ("KSampler", "seed")}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT: the title bar is drawn above a node's pos


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def is_ui(workflow: object) -> bool:
    return isinstance(workflow, dict) and "nodes" in workflow and "links" in workflow


# API files live in api/: ComfyUI lists every .json directly in workflows/ in its templates browser
# (not those in subfolders), and an API file opened from there gives an empty graph.
API_DIR = WORKFLOWS / "api"
# The basic workflow with ComfyUI-Distributed's nodes: an API file with no UI file, which needs the other pack
# (tests/test_comfyui_distributed.py checks it and runs it).
DISTRIBUTED_API = API_DIR / "pixart_lowvram_distributed_api.json"
UI_FILES = sorted(WORKFLOWS.glob("*.json"))
API_FILES = sorted(path for path in API_DIR.glob("*.json") if path != DISTRIBUTED_API)
PAIRS = [(path, API_DIR / (path.stem + "_api.json")) for path in UI_FILES]
NAMES = ("basic", "lora_ksampler", "low_vram", "memory_debug", "with_core_nodes")


def api_file(name: str) -> Path:
    return API_DIR / f"pixart_lowvram_{name}_api.json"


def ui_file(name: str) -> Path:
    return WORKFLOWS / f"pixart_lowvram_{name}.json"


def ids(paths: list[Path]) -> list[str]:
    return [path.stem for path in paths]


def is_link(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
    )


def widget_names(node_type: str) -> tuple[str, ...]:
    return VIRTUAL[node_type] if node_type in VIRTUAL else WIDGETS[node_type]


def ui_widgets(node: dict) -> dict[str, object]:
    """The node's widget values by input name, control-after-generate values checked and dropped."""
    values = list(node["widgets_values"])
    named = {}
    for name in widget_names(node["type"]):
        assert values, f"node {node['id']} ({node['type']}) has no value for widget {name!r}"
        named[name] = values.pop(0)
        if (node["type"], name) in CONTROLLED:
            control = values.pop(0) if values else None
            assert control in CONTROL_VALUES, f"node {node['id']}: {name!r} is followed by {control!r}"
    assert not values, f"node {node['id']} ({node['type']}) has extra widget values {values}"
    return named


def api_widgets(entry: dict) -> dict[str, object]:
    return {name: value for name, value in entry["inputs"].items() if not is_link(value)}


def test_the_bundled_workflows_are_all_there():
    """The workflows of NAMES, each as a UI file, an API file and a thumbnail, and the distributed API file;
    nothing else in the folder, which ComfyUI serves as it is (tools/make_thumbnails.py draws the thumbnails)."""
    assert ids(UI_FILES) == [f"pixart_lowvram_{name}" for name in NAMES]
    assert ids(API_FILES) == [f"pixart_lowvram_{name}_api" for name in NAMES]
    expected = {path.name for path in UI_FILES} | {path.stem + ".jpg" for path in UI_FILES}
    expected.add("api")
    assert {path.name for path in WORKFLOWS.iterdir()} == expected
    api_names = {path.name for path in API_FILES} | {DISTRIBUTED_API.name}
    assert {path.name for path in API_DIR.iterdir()} == api_names
    assert all(is_ui(read(path)) for path in UI_FILES) and not any(is_ui(read(path)) for path in API_FILES)


def test_no_other_folder_comfyui_takes_for_workflows():
    """ComfyUI (app/custom_node_manager.py, v0.3.64 to v0.33.0) lists and serves a pack's workflows from
    any of these folders as well as workflows/; with two of them, the first one mounted would hide the
    other's files on the older versions. workflows/ is the one the pack's layout names."""
    others = ("example_workflows", "example", "examples", "workflow")
    assert [name for name in others if (WORKFLOWS.parent / name).exists()] == []


@pytest.mark.parametrize("path", UI_FILES, ids=ids(UI_FILES))
def test_ui_workflow_has_a_templates_browser_thumbnail(path):
    """ComfyUI's templates browser shows a pack's workflow with the picture at the same name, .jpg."""
    with Image.open(path.with_suffix(".jpg")) as image:
        assert image.format == "JPEG"
        assert image.width == image.height >= 256


@pytest.mark.parametrize("path", UI_FILES, ids=ids(UI_FILES))
def test_ui_workflow_is_a_consistent_type_correct_graph(path):
    ui = read(path)
    assert ui["version"] == 0.4
    assert {"groups", "config", "extra"} <= set(ui)
    nodes = {node["id"]: node for node in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]), "node ids are unique"
    links = {link[0]: link for link in ui["links"]}
    assert len(links) == len(ui["links"]), "link ids are unique"
    assert ui["last_node_id"] == max(nodes)
    assert ui["last_link_id"] == max(links)

    for node in ui["nodes"]:
        assert node["type"] in WIDGETS or node["type"] in VIRTUAL, f"node {node['id']}: unknown type"
        assert node["mode"] == 0
        assert len(node["pos"]) == 2 and len(node["size"]) == 2
        ui_widgets(node)
        if node["type"] in VIRTUAL:
            assert node["inputs"] == [] and node["outputs"] == []
            continue
        assert node["properties"]["Node name for S&R"] == node["type"]
        inputs, outputs = SOCKETS[node["type"]]
        assert [s["name"] for s in node["inputs"]] == [name for name, _kind, _optional in inputs]
        assert [o["name"] for o in node["outputs"]] == [name for name, _kind in outputs]
        matched = set()
        for socket, (name, kind, optional) in zip(node["inputs"], inputs, strict=True):
            if socket["link"] is None:
                assert optional and socket.get("shape") == OPTIONAL_SHAPE, f"node {node['id']} input {name!r}"
                continue
            link = links.get(socket["link"])
            slot = [s["name"] for s in node["inputs"]].index(name)
            assert link is not None and link[3:5] == [node["id"], slot], (
                f"node {node['id']} input {name!r} points at link {socket['link']}"
            )
            assert socket["type"] == link[5], f"node {node['id']} input {name!r}"
            if kind == ANY:
                matched.add(link[5])
            else:
                assert link[5] == kind, f"node {node['id']} input {name!r} takes {kind}, is linked {link[5]}"
        for slot, (output, (name, kind)) in enumerate(zip(node["outputs"], outputs, strict=True)):
            assert output["slot_index"] == slot
            assert output["type"] == (matched.pop() if kind == ANY else kind), f"node {node['id']} {name}"
            assert all(links[i][1:3] == [node["id"], slot] for i in output["links"])

    for link_id, from_node, from_slot, to_node, _to_slot, kind in ui["links"]:
        output = nodes[from_node]["outputs"][from_slot]
        assert link_id in output["links"], f"link {link_id} is missing from node {from_node}'s output"
        assert output["type"] == kind
        assert nodes[from_node]["order"] < nodes[to_node]["order"], "order runs along the links"
    assert sorted(node["order"] for node in ui["nodes"]) == list(range(len(nodes)))


def boxes_overlap(a: dict, b: dict) -> bool:
    """Whether two nodes' boxes (title bar included) overlap on the canvas."""
    ax, ay, bx, by = a["pos"][0], a["pos"][1] - TITLE_HEIGHT, b["pos"][0], b["pos"][1] - TITLE_HEIGHT
    aw, ah, bw, bh = a["size"][0], a["size"][1] + TITLE_HEIGHT, b["size"][0], b["size"][1] + TITLE_HEIGHT
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


@pytest.mark.parametrize("path", UI_FILES, ids=ids(UI_FILES))
def test_ui_workflow_layout_has_no_overlapping_nodes_and_a_note(path):
    nodes = read(path)["nodes"]
    for index, a in enumerate(nodes):
        for b in nodes[index + 1 :]:
            assert not boxes_overlap(a, b), f"{path.name}: nodes {a['id']} and {b['id']} overlap"
    notes = [node for node in nodes if node["type"] in VIRTUAL]
    assert len(notes) == 1 and notes[0]["widgets_values"][0].startswith("## "), (
        "one note tells what it is for"
    )


@pytest.mark.parametrize("path", API_FILES, ids=ids(API_FILES))
def test_api_workflow_names_known_inputs_and_links(path):
    api = read(path)
    for key, entry in api.items():
        kind = entry["class_type"]
        assert kind in INPUT_ORDER, f"API node {key}: {kind} is not a node this test knows"
        declared = INPUT_ORDER[kind]
        assert list(entry["inputs"]) == [name for name in declared if name in entry["inputs"]], (
            f"API node {key}: inputs are known and in declared order"
        )
        assert list(api_widgets(entry)) == list(WIDGETS[kind]), f"API node {key}: every widget is set"
        sockets = {name: (socket_kind, optional) for name, socket_kind, optional in SOCKETS[kind][0]}
        for name, (socket_kind, optional) in sockets.items():
            value = entry["inputs"].get(name)
            if value is None:
                assert optional, f"API node {key}: required input {name!r} is not linked"
                continue
            assert is_link(value), f"API node {key} input {name!r} is a socket: {value!r} is not a link"
            source, slot = value
            assert source in api, f"API node {key} input {name!r} links to missing node {source}"
            outputs = SOCKETS[api[source]["class_type"]][1]
            assert slot < len(outputs), f"API node {key} input {name!r}: node {source} has no output {slot}"
            source_kind = output_type(api, source, slot)
            assert socket_kind in (ANY, source_kind), (
                f"API node {key} input {name!r} takes {socket_kind}, is linked to {source_kind}"
            )
        assert entry["_meta"]["title"], f"API node {key} has a title"


def output_type(api: dict, key: str, slot: int) -> str:
    """The type of an API node's output, following pass-through nodes back to what feeds them."""
    inputs, outputs = SOCKETS[api[key]["class_type"]]
    kind = outputs[slot][1]
    if kind != ANY:
        return kind
    (name,) = [name for name, socket_kind, _optional in inputs if socket_kind == ANY]
    source, source_slot = api[key]["inputs"][name]
    return output_type(api, source, source_slot)


@pytest.mark.parametrize(("ui_path", "api_path"), PAIRS, ids=ids(UI_FILES))
def test_ui_and_api_workflows_describe_the_same_graph(ui_path, api_path):
    ui, api = read(ui_path), read(api_path)
    nodes = {str(node["id"]): node for node in ui["nodes"] if node["type"] not in VIRTUAL}
    assert set(nodes) == set(api), "the same node ids"
    for node_id, entry in api.items():
        assert nodes[node_id]["type"] == entry["class_type"]
        title = nodes[node_id].get("title")
        if title:
            assert entry["_meta"]["title"] == title, f"node {node_id}: the same title"

    api_links = {
        (node_id, name): (value[0], value[1])
        for node_id, entry in api.items()
        for name, value in entry["inputs"].items()
        if is_link(value)
    }
    ui_links = {
        (str(to_node), nodes[str(to_node)]["inputs"][to_slot]["name"]): (str(from_node), from_slot)
        for _id, from_node, from_slot, to_node, to_slot, _kind in ui["links"]
    }
    assert ui_links == api_links

    for node_id, entry in api.items():
        typed = [(name, value, type(value)) for name, value in ui_widgets(nodes[node_id]).items()]
        expected = [(name, value, type(value)) for name, value in api_widgets(entry).items()]
        assert typed == expected, f"node {node_id}: the same widget values"


def all_workflows() -> list[tuple[Path, str, str, object]]:
    """(file, node id, input name, value) of every widget value in every workflow file."""
    found = []
    for path in UI_FILES:
        for node in read(path)["nodes"]:
            found += [(path, str(node["id"]), k, v) for k, v in ui_widgets(node).items()]
    for path in API_FILES:
        for key, entry in read(path).items():
            found += [(path, key, k, v) for k, v in api_widgets(entry).items()]
    return found


def test_workflows_name_models_not_paths():
    """Models are named as ComfyUI lists them, relative to its standard model folders (models/diffusers,
    models/text_encoders, models/vae), so the same file runs on every server that has them."""
    models = [
        (path.name, key, name, value) for path, key, name, value in all_workflows() if name in MODEL_INPUTS
    ]
    assert len(models) >= 20
    for where in models:
        value = where[3]
        assert isinstance(value, str) and value, where
        assert not PurePosixPath(value).is_absolute() and not PureWindowsPath(value).is_absolute(), where
        assert "/" not in value and "\\" not in value and ".." not in value and "~" not in value, where


def test_workflows_write_only_under_prefixes():
    """Output nodes take a file name prefix, never a path: ComfyUI numbers the files in its output folder."""
    prefixes = [where for where in all_workflows() if where[2] == "filename_prefix"]
    assert len(prefixes) >= 8
    for path, key, _name, value in prefixes:
        assert isinstance(value, str) and value.replace("_", "").isalnum(), (path.name, key, value)


def widgets_of(name: str, class_type: str) -> list[dict]:
    return [api_widgets(e) for e in read(api_file(name)).values() if e["class_type"] == class_type]


def test_every_workflow_makes_a_1024_image_in_20_steps():
    for name in NAMES:
        if widgets_of(name, "KSampler"):  # core's KSampler on an Empty Latent Image
            (sampler,) = widgets_of(name, "KSampler")
            (latent,) = widgets_of(name, "EmptyLatentImage")
            sampler = {**latent, **sampler, "resolution": "custom"}
        else:
            (sampler,) = widgets_of(name, "PixArtQ_Sampler")
        assert (sampler["width"], sampler["height"], sampler["steps"], sampler["batch_size"]) == (
            1024,
            1024,
            20,
            1,
        ), name
        assert sampler["resolution"] == "custom" and math.isclose(sampler["denoise"], 1.0)
        models = {
            w["model"]
            for kind in WIDGETS
            if kind.startswith("PixArtQ_")
            for w in widgets_of(name, kind)
            if "model" in w
        }
        assert models == {"PixArt-Sigma-XL-2-1024-MS"}, name


def test_low_vram_workflow_uses_the_smallest_settings():
    (encoder,) = widgets_of("low_vram", "PixArtQ_T5Encode")
    (sampler,) = widgets_of("low_vram", "PixArtQ_Sampler")
    (decode,) = widgets_of("low_vram", "PixArtQ_VAEDecode")
    assert encoder["low_vram"] is True and sampler["low_vram"] is True
    assert encoder["quantization"] == "nf4" and sampler["quantization"] == "qint8"
    assert decode["tiling"] == "on"
    assert not any(w["keep_loaded"] for w in (encoder, sampler, decode))
    for name in ("basic", "lora_ksampler", "memory_debug", "with_core_nodes"):
        assert all(
            w["low_vram"] is False
            for kind in ("PixArtQ_T5Encode", "PixArtQ_Sampler")
            for w in widgets_of(name, kind)
        )


def chain(api: dict) -> list[str]:
    """The class types from the text encoder to the first Save Image, following the links back."""
    (key,) = [k for k, e in api.items() if e["class_type"] == "SaveImage"]
    types = []
    while True:
        types.append(api[key]["class_type"])
        links = [v for v in api[key]["inputs"].values() if is_link(v)]
        if not links:
            return types[::-1]
        key = links[0][0]


def test_memory_debug_workflow_frees_after_every_stage_and_snapshots():
    assert chain(read(api_file("memory_debug"))) == [
        "PixArtQ_T5Encode",
        "PixArtQ_FreeVRAM",
        "PixArtQ_Sampler",
        "PixArtQ_FreeVRAM",
        "PixArtQ_VAEDecode",
        "PixArtQ_FreeVRAM",
        "PixArtQ_MemorySnapshot",
        "SaveImage",
    ]
    assert chain(read(api_file("basic"))) == [
        "PixArtQ_T5Encode",
        "PixArtQ_Sampler",
        "PixArtQ_VAEDecode",
        "PixArtQ_MemorySnapshot",
        "SaveImage",
    ]
    # The debugging workflow records the allocator history; the basic one only reports (the default).
    (debug,) = widgets_of("memory_debug", "PixArtQ_MemorySnapshot")
    (basic,) = widgets_of("basic", "PixArtQ_MemorySnapshot")
    assert debug["allocator_history"] is True and basic["allocator_history"] is False


def test_with_core_nodes_workflow_decodes_the_latent_with_core_nodes():
    api = read(api_file("with_core_nodes"))
    by_type = {entry["class_type"]: key for key, entry in api.items()}
    assert set(by_type) == {
        "PixArtQ_T5Encode",
        "PixArtQ_Sampler",
        "VAELoader",
        "VAEDecode",
        "SaveImage",
        "PreviewImage",
    }
    assert api[by_type["VAELoader"]]["inputs"]["vae_name"] == "sdxl_vae.safetensors"
    decode = api[by_type["VAEDecode"]]["inputs"]
    assert decode == {"samples": [by_type["PixArtQ_Sampler"], 0], "vae": [by_type["VAELoader"], 0]}
    for output in ("SaveImage", "PreviewImage"):
        assert api[by_type[output]]["inputs"]["images"] == [by_type["VAEDecode"], 0]


def test_lora_ksampler_workflow_runs_the_packs_model_through_core_lora_and_ksampler():
    api = read(api_file("lora_ksampler"))
    by_type = {entry["class_type"]: key for key, entry in api.items()}
    assert len(by_type) == len(api) and chain(api) == [
        "PixArtQ_ModelLoader",
        "LoraLoaderModelOnly",
        "KSampler",
        "PixArtQ_VAEDecode",
        "SaveImage",
    ]
    loader = api[by_type["PixArtQ_ModelLoader"]]["inputs"]
    assert loader["quantization"] == "qint8" and loader["transformer_file"] == "(from model)"
    lora = api[by_type["LoraLoaderModelOnly"]]["inputs"]
    assert lora["lora_name"].endswith(".safetensors") and math.isclose(lora["strength_model"], 1.0)
    sampler = api[by_type["KSampler"]]["inputs"]
    encoder = by_type["PixArtQ_T5Encode"]
    assert (sampler["positive"], sampler["negative"]) == ([encoder, 1], [encoder, 2])
    assert sampler["latent_image"] == [by_type["EmptyLatentImage"], 0]
    assert (sampler["sampler_name"], sampler["scheduler"], sampler["cfg"]) == ("dpmpp_2m", "normal", 4.5)


@pytest.mark.parametrize("keep", [None, True])
def test_the_server_sequence_sets_every_api_workflow(keep):
    """The GPU sequence (tests/server_sequence.py) sets model, size and steps on every bundled API
    workflow without touching a linked input (the client refuses those: --set sets widget values only)."""
    from server_sequence import Settings, build_prompt

    settings = Settings(model="tiny", size=64, ksampler_size=320, steps=2)
    for path in settings.workflows:
        prompt = build_prompt(path, settings, index=1, steps=2, keep=keep)
        sizes = {
            (node["inputs"]["width"], node["inputs"]["height"])
            for node in prompt.values()
            if node["class_type"] in ("PixArtQ_Sampler", "EmptyLatentImage")
        }
        assert sizes in ({(64, 64)}, {(320, 320)}), (path.name, sizes)
        assert all(
            node["inputs"]["model"] == "tiny"
            for node in prompt.values()
            if isinstance(node["inputs"].get("model"), str)
        ), path.name
