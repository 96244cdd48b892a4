"""The bundled workflows: the UI (drag-and-drop) file is a consistent litegraph graph, and it describes
the same graph as the API (queueing) file. The comfyui tier checks both against a real server's
/object_info; this test needs no ComfyUI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
UI_FILE = WORKFLOWS / "pixart_lowvram_basic.json"
API_FILE = WORKFLOWS / "pixart_lowvram_basic_api.json"

# Each node type's widget inputs in /object_info's input_order; the frontend stores their values in
# this order. Inputs that take a link (embeds, latent, value, images) are sockets, not widgets.
WIDGETS = {
    "PixArtQ_T5Encode": ("model", "prompt", "negative_prompt", "quantization", "keep_loaded", "t5_file"),
    "PixArtQ_Sampler": (
        "model",
        "width",
        "height",
        "steps",
        "cfg",
        "seed",
        "batch_size",
        "weights",
        "keep_loaded",
        "resolution",
        "scheduler",
        "denoise",
    ),
    "PixArtQ_VAEDecode": ("model", "keep_loaded", "tiling"),
    "PixArtQ_FreeVRAM": (),
    "PixArtQ_MemorySnapshot": ("filename_prefix",),
    "SaveImage": ("filename_prefix",),
}
# The frontend draws optional inputs with this shape (a hollow circle); only they may be left unlinked.
OPTIONAL_SHAPE = 7
# Widgets the frontend follows with a "control after generate" value of its own.
CONTROLLED = {("PixArtQ_Sampler", "seed")}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}


@pytest.fixture(scope="module")
def ui() -> dict:
    return json.loads(UI_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def api() -> dict:
    return json.loads(API_FILE.read_text(encoding="utf-8"))


def is_link(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
    )


def ui_widgets(node: dict) -> dict[str, object]:
    """The node's widget values by input name, control-after-generate values checked and dropped."""
    values = list(node["widgets_values"])
    named = {}
    for name in WIDGETS[node["type"]]:
        assert values, f"node {node['id']} ({node['type']}) has no value for widget {name!r}"
        named[name] = values.pop(0)
        if (node["type"], name) in CONTROLLED:
            control = values.pop(0) if values else None
            assert control in CONTROL_VALUES, f"node {node['id']}: {name!r} is followed by {control!r}"
    assert not values, f"node {node['id']} ({node['type']}) has extra widget values {values}"
    return named


def test_ui_workflow_is_a_consistent_graph(ui):
    assert ui["version"] == 0.4
    assert {"groups", "config", "extra"} <= set(ui)
    nodes = {node["id"]: node for node in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]), "node ids are unique"
    links = {link[0]: link for link in ui["links"]}
    assert len(links) == len(ui["links"]), "link ids are unique"
    assert ui["last_node_id"] == max(nodes)
    assert ui["last_link_id"] == max(links)

    for link_id, from_node, from_slot, to_node, to_slot, kind in ui["links"]:
        output = nodes[from_node]["outputs"][from_slot]
        assert link_id in output["links"], f"link {link_id} is missing from node {from_node}'s output"
        assert output["type"] == kind and output["slot_index"] == from_slot
        target = nodes[to_node]["inputs"][to_slot]
        assert target["link"] == link_id, f"link {link_id} is not node {to_node}'s input {to_slot}"
        assert target["type"] == kind
        assert nodes[from_node]["order"] < nodes[to_node]["order"], "order runs along the links"

    for node in ui["nodes"]:
        for slot, socket in enumerate(node["inputs"]):
            if socket["link"] is None:
                assert socket.get("shape") == OPTIONAL_SHAPE, f"node {node['id']} input {socket['name']!r}"
                continue
            link = links.get(socket["link"])
            assert link is not None and link[3:5] == [node["id"], slot], (
                f"node {node['id']} input {socket['name']!r} points at link {socket['link']}"
            )
        for slot, output in enumerate(node["outputs"]):
            assert all(links[i][1:3] == [node["id"], slot] for i in output["links"])
        assert node["mode"] == 0
        assert node["properties"]["Node name for S&R"] == node["type"]
        assert len(node["pos"]) == 2 and len(node["size"]) == 2
        ui_widgets(node)
    assert sorted(node["order"] for node in ui["nodes"]) == list(range(len(nodes)))


def test_ui_and_api_workflows_describe_the_same_graph(ui, api):
    nodes = {str(node["id"]): node for node in ui["nodes"]}
    assert set(nodes) == set(api), "the same node ids"
    for node_id, entry in api.items():
        assert nodes[node_id]["type"] == entry["class_type"]

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
        widgets = {name: value for name, value in entry["inputs"].items() if not is_link(value)}
        assert list(widgets) == list(WIDGETS[entry["class_type"]]), (
            f"API node {node_id}: widget inputs in order"
        )
        typed = [(name, value, type(value)) for name, value in ui_widgets(nodes[node_id]).items()]
        assert typed == [(name, value, type(value)) for name, value in widgets.items()], (
            f"node {node_id}: the same widget values"
        )
