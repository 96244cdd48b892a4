"""Memory Snapshot's timeline in a real ComfyUI server (the ``comfyui`` tier): the picture shown on the node
with the stage table, the same picture on its IMAGE output, and the files in the output folder; without
allocator history and with the output unlinked, the table alone."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import requests
from comfyui_support import HTTP_TIMEOUT, basic_prompt, new_files, node_id
from PIL import Image

pytestmark = pytest.mark.comfyui

PICTURE_SIZE = (1000, 500)


def test_basic_workflow_shows_and_writes_the_timeline(server):
    prompt = basic_prompt()
    snapshot = node_id(prompt, "PixArtQ_MemorySnapshot")
    # The timeline output (slot 1, after the pass-through) into core's Save Image.
    prompt["timeline_save"] = {
        "class_type": "SaveImage",
        "inputs": {"images": [snapshot, 1], "filename_prefix": "timeline_output"},
    }
    before = set(server.output.iterdir())
    run = server.run(prompt)
    assert run.status == "success", run.error

    (preview,) = run.outputs[snapshot]["images"]
    assert preview["type"] == "temp"  # a preview, not one of the prompt's results
    response = requests.get(
        server.url + "/view",
        params={"filename": preview["filename"], "subfolder": preview["subfolder"], "type": "temp"},
        timeout=HTTP_TIMEOUT,
    )
    response.raise_for_status()
    with Image.open(io.BytesIO(response.content)) as image:
        assert image.size == PICTURE_SIZE
        shown = np.asarray(image.convert("RGB"), dtype=np.int16)

    text = run.text(snapshot)
    assert "| stage |" in text and "sample" in text and "vae_decode" in text
    assert "no CUDA" in text

    # One numbered stem for the table, the picture and (with CUDA) the snapshot.
    (md,) = new_files(server.output, before, "pixart_memory_*.md")
    stem = md.name.removesuffix(".md")
    png, record = server.output / f"{stem}.png", server.output / f"{stem}.json"
    assert png.is_file() and record.is_file()
    assert not (server.output / f"{stem}.pickle").exists()  # the server runs with --cpu
    assert all(path.name in text for path in (md, png, record))
    with Image.open(png) as saved:
        # The preview went through ComfyUI's IMAGE (float) to PNG conversion, which truncates: ±1.
        assert np.abs(np.asarray(saved.convert("RGB"), dtype=np.int16) - shown).max() <= 1
    stages = json.loads(record.read_text())["stages"]
    assert [s["stage"] for s in stages][-2:] == ["sample", "vae_decode"]
    assert all(s["started_us"] <= s["ended_us"] for s in stages)

    # The IMAGE output holds the same picture.
    (output,) = run.outputs["timeline_save"]["images"]
    with Image.open(server.output / output["subfolder"] / output["filename"]) as from_output:
        assert np.array_equal(np.asarray(from_output.convert("RGB"), dtype=np.int16), shown)


def test_a_timeline_linked_after_a_run_is_drawn_not_taken_from_the_cache(server):
    """The basic workflow only reports (allocator_history off, timeline unlinked): no picture, no .png.
    Queued again with the timeline linked and every input unchanged, the node runs again and draws: ComfyUI
    caches on a node's inputs, not on what takes its outputs, and the placeholder is not reused."""
    prompt = basic_prompt()
    snapshot = node_id(prompt, "PixArtQ_MemorySnapshot")
    prompt[snapshot]["inputs"]["filename_prefix"] = "relinked"  # a node of its own in the server's cache
    assert prompt[snapshot]["inputs"]["allocator_history"] is False
    before = set(server.output.iterdir())
    run = server.run(prompt)
    assert run.status == "success", run.error
    assert "images" not in run.outputs[snapshot], "no picture on the node"
    assert "not asked for" in run.text(snapshot)
    assert sorted(p.suffix for p in new_files(server.output, before, "relinked_*")) == [".json", ".md"]

    prompt["timeline_save"] = {
        "class_type": "SaveImage",
        "inputs": {"images": [snapshot, 1], "filename_prefix": "relinked_output"},
    }
    run = server.run(prompt)
    assert run.status == "success", run.error
    assert snapshot in run.executed
    (output,) = run.outputs["timeline_save"]["images"]
    with Image.open(server.output / output["subfolder"] / output["filename"]) as image:
        assert image.size == PICTURE_SIZE
    (preview,) = run.outputs[snapshot]["images"]
    assert preview["type"] == "temp"
