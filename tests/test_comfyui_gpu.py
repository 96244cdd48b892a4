"""The ComfyUI sequence on the GPU (``comfyui`` and ``gpu`` tiers: ``pytest -m "comfyui and gpu"`` on the GPU
machine, with COMFYUI_PATH): a real ComfyUI server started without --cpu, so with the version's defaults
(Dynamic VRAM on where it has it, e.g. v0.33.0), runs the ComfyUI sequence's steps (server_sequence.py) on the tiny
model — the pack loads, every bundled API workflow, keep_loaded prompts, POST /free, a third prompt, Cancel
during sampling and a prompt after it, a core VAE after kept pack models, /free again — and the allocated
memory after each /free is back to the level before the first prompt.

Skipped without CUDA (it is in the comfyui tier too, which runs on CPU machines).
"""

from __future__ import annotations

import pytest
import torch
from comfyui_support import MODEL, SIZE, STEPS, running_server
from server_sequence import Settings, run_sequence

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: run on the GPU machine (pytest -m 'comfyui and gpu')",
    ),
]

LIMIT_MIB = 64


@pytest.fixture(scope="module")
def sequence(request, tmp_path_factory, tiny_folder, sdxl_vae_file) -> dict:
    settings = Settings(
        model=MODEL, size=SIZE, ksampler_size=320, steps=STEPS, limit_mib=LIMIT_MIB, prompt_timeout=300
    )
    with running_server(
        request, tmp_path_factory.mktemp("comfyui"), tiny_folder, sdxl_vae_file=sdxl_vae_file, cpu=False
    ) as server:
        return run_sequence(server.url, server.log, settings)


def test_the_server_runs_on_the_gpu(sequence):
    assert sequence["server"]["device_type"] == "cuda", sequence["server"]


def test_every_step_succeeds(sequence):
    failed = {s["name"]: s.get("error") for s in sequence["steps"] if not s["passed"]}
    assert not failed, f"{failed}\nserver log, last lines:\n" + "\n".join(sequence["log"]["tail"])
    names = [s["name"] for s in sequence["steps"]]
    assert names[0] == "pack loaded" and names[-1] == "final /free", names


def test_every_bundled_workflow_ran(sequence):
    ran = {
        s["name"].removeprefix("workflow ") for s in sequence["steps"] if s["name"].startswith("workflow ")
    }
    assert ran == set(sequence["settings"]["workflows"]) and len(ran) >= 4


def test_no_traceback_in_the_server_log(sequence):
    log = sequence["log"]
    assert log["tracebacks"] == 0, "\n\n".join(log["traceback_excerpts"])


def test_allocated_after_free_is_back_to_the_level_before_the_first_prompt(sequence):
    check = sequence["memory_check"]
    assert check["passed"] is True, check["detail"]
    assert set(check["after_mib"]) == {"/free", "final /free"}
