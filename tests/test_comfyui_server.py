"""The pack inside a real ComfyUI server (the ``comfyui`` tier): /object_info, the bundled workflows
queued through POST /prompt and followed on the websocket (progress, previews, Cancel), errors as the
user sees them, and kept models released by Free VRAM.

One server (``--cpu --preview-method auto``, comfyui_support.py) runs for the module on a free local port, in a temporary
base directory whose custom_nodes/ links to this repository and whose models/diffusers/ holds the tiny
random model.
Needs COMFYUI_PATH (a ComfyUI checkout); COMFYUI_PYTHON names its interpreter (default: this one).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from comfyui_support import (
    API_WORKFLOW,
    HTTP_TIMEOUT,
    HUB_ID,
    MODEL,
    MODEL_NODES,
    NODE_IDS,
    PACK_LINK,
    PREVIEW_SIZE,
    PROMPT_TIMEOUT,
    SIZE,
    STEPS,
    ComfyServer,
    basic_prompt,
    free_vram_prompt,
    new_files,
    node_id,
    progress_is_throttled,
    strip_colour,
)
from PIL import Image

pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)


def test_the_pack_loads_without_a_traceback(server):
    """ComfyUI lists the pack among the custom nodes it imported, not as failed, and no Traceback in its
    start-up log (up to "To see the GUI go to") comes from the pack; ComfyUI's own optional nodes may log
    theirs for a package the machine lacks."""
    log = strip_colour(server.log_text())
    startup = log.split("To see the GUI go to", 1)[0]
    assert len(startup) < len(log), "the server has not logged that it is up"
    lines = [line for line in startup.splitlines() if PACK_LINK in line]
    assert any("seconds" in line for line in lines), "ComfyUI's import times do not list the pack"
    assert not [line for line in lines if "IMPORT FAILED" in line]
    tracebacks = startup.split("Traceback (most recent call last):")[1:]
    ours = [
        block[:2000] for block in tracebacks if "pixart_lowvram" in block[:2000] or PACK_LINK in block[:2000]
    ]
    assert not ours, ours


def test_object_info_describes_the_nodes(server):
    info = server.get("/object_info")
    pack = {name: node for name, node in info.items() if name.startswith("PixArtQ_")}
    assert sorted(pack) == sorted(NODE_IDS)
    categories = {node["category"] for node in pack.values()}
    assert len(categories) == 1, categories
    for name, node in pack.items():
        assert node["python_module"].startswith("custom_nodes."), name
        assert node["description"].strip(), f"{name} has no description"
        for section in ("required", "optional"):
            for input_name, (_kind, options) in node["input"].get(section, {}).items():
                assert options.get("tooltip"), f"{name} input {input_name!r} has no tooltip"
    for name in MODEL_NODES:
        options = pack[name]["input"]["required"]["model"][1]["options"]
        assert MODEL in options and HUB_ID in options, options


def test_basic_workflow_renders_an_image_and_a_memory_record(server):
    prompt = basic_prompt()
    sampler, snapshot = node_id(prompt, "PixArtQ_Sampler"), node_id(prompt, "PixArtQ_MemorySnapshot")
    before, log_start = set(server.output.iterdir()), server.log.stat().st_size
    run = server.run(prompt)
    assert run.status == "success", run.error
    # transformers' bars as T5 loads and is saved pre-quantized are not in the server's log.
    log = server.log_text(log_start)
    assert "Loading weights" not in log and "Writing model shards" not in log, log[-2000:]

    progress = [data for data in run.of_type("progress") if data["node"] == sampler]
    assert progress, "the sampler drives ComfyUI's progress bar"
    assert progress[-1]["value"] == STEPS and {data["max"] for data in progress} == {STEPS}

    (saved,) = run.outputs[node_id(prompt, "SaveImage")]["images"]
    with Image.open(server.output / saved["subfolder"] / saved["filename"]) as image:
        assert image.size == (SIZE, SIZE)

    text = run.text(snapshot)
    assert "no CUDA" in text
    assert "host memory: " in text and " model(s) waiting for the next run" in text, text
    assert "Free VRAM empties it" in text
    (md,) = new_files(server.output, before, "pixart_memory_*.md")
    (record,) = new_files(server.output, before, "pixart_memory_*.json")
    assert md.name in text and record.name in text
    # allocator_history off, the timeline unlinked: the table only, nothing drawn.
    assert new_files(server.output, before, "pixart_memory_*.png") == []
    assert new_files(server.output, before, "pixart_memory_*.pickle") == []
    assert "images" not in run.outputs[snapshot]
    stages = [stage["stage"] for stage in json.loads(record.read_text())["stages"]]
    cached = {node for data in run.of_type("execution_cached") for node in data["nodes"]}
    expected = ["sample", "vae_decode"]
    if node_id(prompt, "PixArtQ_T5Encode") not in cached:
        expected.insert(0, "t5_encode")
    assert stages == expected
    assert all(stage in md.read_text() for stage in expected)


def test_free_vram_between_sampler_and_decode(server):
    prompt = basic_prompt(seed=1)
    sampler, decode = node_id(prompt, "PixArtQ_Sampler"), node_id(prompt, "PixArtQ_VAEDecode")
    prompt["free"] = {"class_type": "PixArtQ_FreeVRAM", "inputs": {"value": [sampler, 0]}}
    prompt[decode]["inputs"]["latent"] = ["free", 0]

    run = server.run(prompt)
    assert run.status == "success", run.error
    order = run.executed
    assert order.index(sampler) < order.index("free") < order.index(decode)
    assert run.text("free").startswith("dropped ") and "kept model(s)" in run.text("free")
    (saved,) = run.outputs[node_id(prompt, "SaveImage")]["images"]
    assert (server.output / saved["subfolder"] / saved["filename"]).is_file()


def test_img2img_from_core_empty_latent(server):
    """Core Empty Latent Image -> sampler (latent, denoise 0.6, euler) -> VAE Decode -> Save Image. The
    latent sets the size: the width widget's 72 is neither used nor refused when queued."""
    prompt = basic_prompt(width=72, denoise=0.6, scheduler="euler", seed=2)
    sampler, decode = node_id(prompt, "PixArtQ_Sampler"), node_id(prompt, "PixArtQ_VAEDecode")
    save = node_id(prompt, "SaveImage")
    del prompt[node_id(prompt, "PixArtQ_MemorySnapshot")]
    prompt[save]["inputs"]["images"] = [decode, 0]
    prompt["empty"] = {
        "class_type": "EmptyLatentImage",
        "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1},
    }
    prompt[sampler]["inputs"]["latent"] = ["empty", 0]

    run = server.run(prompt)
    assert run.status == "success", run.error
    progress = [data for data in run.of_type("progress") if data["node"] == sampler]
    kept = round(STEPS * 0.6)
    assert progress[-1]["value"] == kept and {data["max"] for data in progress} == {kept}
    (saved,) = run.outputs[save]["images"]
    with Image.open(server.output / saved["subfolder"] / saved["filename"]) as image:
        assert image.size == (SIZE, SIZE)


def test_img2img_from_core_latent_upscale(server):
    """The sampler's first LATENT -> core Latent Upscale (to 96 × 64) -> a second sampler pass at denoise
    0.5 -> VAE Decode: the upscaled latent sets the second pass's size."""
    prompt = basic_prompt(seed=3)
    sampler, decode = node_id(prompt, "PixArtQ_Sampler"), node_id(prompt, "PixArtQ_VAEDecode")
    save = node_id(prompt, "SaveImage")
    del prompt[node_id(prompt, "PixArtQ_MemorySnapshot")]
    prompt[save]["inputs"]["images"] = [decode, 0]
    prompt["upscale"] = {
        "class_type": "LatentUpscale",
        "inputs": {
            "samples": [sampler, 0],
            "upscale_method": "bilinear",
            "width": 96,
            "height": 64,
            "crop": "disabled",
        },
    }
    prompt["second"] = {
        "class_type": "PixArtQ_Sampler",
        "inputs": {**prompt[sampler]["inputs"], "latent": ["upscale", 0], "denoise": 0.5},
    }
    prompt[decode]["inputs"]["latent"] = ["second", 0]

    run = server.run(prompt)
    assert run.status == "success", run.error
    (saved,) = run.outputs[save]["images"]
    with Image.open(server.output / saved["subfolder"] / saved["filename"]) as image:
        assert image.size == (96, 64)


def test_sampler_sends_a_latent_preview_every_step(server):
    """With --preview-method auto (latent-to-RGB in ComfyUI 0.8) every sampler step sends a JPEG preview
    with the sampler's node id; a prompt that turns previews off (the web UI's preview setting) gets
    progress without them."""
    prompt = basic_prompt(seed=41)
    sampler = node_id(prompt, "PixArtQ_Sampler")
    run = server.run(prompt)
    assert run.status == "success", run.error
    assert [preview.node for preview in run.previews] == [sampler] * STEPS
    for preview in run.previews:
        assert preview.mimetype == "image/jpeg"
        image = preview.image()
        assert image.format == "JPEG" and image.mode == "RGB" and image.size == (PREVIEW_SIZE, PREVIEW_SIZE)
        low, high = zip(*image.getextrema(), strict=True)
        assert max(high) - min(low) > 16, "a flat preview shows nothing of the latents"

    quiet = server.run(basic_prompt(seed=42), extra_data={"preview_method": "none"})
    assert quiet.status == "success", quiet.error
    assert quiet.previews == []
    values = [data["value"] for data in quiet.of_type("progress") if data["node"] == sampler]
    if progress_is_throttled():  # ComfyUI sends the first and the last, and others 0.1 s apart
        assert values[0] == 1 and values[-1] == STEPS and values == sorted(set(values)), values
    else:
        assert values == list(range(1, STEPS + 1))


def red_taesdxl_decoder() -> dict:
    """A taesdxl_decoder file's tensors (comfy/taesd/taesd.py ``Decoder``; modules without weights are
    placeholders here, so the indices match) that decode anything to pure red: every weight zero, the
    last convolution's bias red."""
    import torch
    from torch import nn

    def conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
        return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)

    def block() -> nn.Module:
        module = nn.Module()
        module.conv = nn.Sequential(conv(64, 64), nn.ReLU(), conv(64, 64), nn.ReLU(), conv(64, 64))
        return module

    def upscale() -> list[nn.Module]:
        return [block(), block(), block(), nn.Upsample(scale_factor=2), conv(64, 64, bias=False)]

    decoder = nn.Sequential(
        nn.Identity(), conv(4, 64), nn.ReLU(), *upscale(), *upscale(), *upscale(), block(), conv(64, 3)
    )
    state = {name: torch.zeros_like(tensor) for name, tensor in decoder.state_dict().items()}
    state[f"{len(decoder) - 1}.bias"] = torch.tensor([1.0, 0.0, 0.0])
    return state


def test_taesd_previews_when_taesdxl_is_installed(server):
    """Previews set to TAESD (the web UI's setting): without taesdxl_decoder in models/vae_approx ComfyUI
    warns and falls back to latent-to-RGB; with it, TAESD-XL decodes the previews (this file's decoder
    paints everything red)."""
    from safetensors.torch import save_file

    sampler = node_id(basic_prompt(), "PixArtQ_Sampler")
    missing = "TAESD previews enabled, but could not find models/vae_approx/taesdxl_decoder"
    log_start = server.log.stat().st_size
    fallback = server.run(basic_prompt(seed=43), extra_data={"preview_method": "taesd"})
    assert fallback.status == "success", fallback.error
    assert missing in server.log_text(log_start)
    assert [preview.node for preview in fallback.previews] == [sampler] * STEPS

    taesd = server.base / "models" / "vae_approx" / "taesdxl_decoder.safetensors"
    save_file(red_taesdxl_decoder(), taesd)
    log_start = server.log.stat().st_size
    try:
        run = server.run(basic_prompt(seed=44), extra_data={"preview_method": "taesd"})
    finally:
        taesd.unlink()
    assert run.status == "success", run.error
    assert missing not in server.log_text(log_start)
    assert [preview.node for preview in run.previews] == [sampler] * STEPS
    for preview in run.previews:
        image = preview.image()
        assert image.size == (PREVIEW_SIZE, PREVIEW_SIZE)
        red, green, blue = image.getextrema()
        assert red[0] > 240 and green[1] < 16 and blue[1] < 16, image.getextrema()


def test_cancel_stops_sampling_at_the_next_step(server):
    """POST /interrupt while the sampler runs (as the web UI's Cancel does): ComfyUI reports the prompt
    interrupted in the sampler, sampling stops within a step or two of it, the transformer is not kept
    (though keep_loaded asked for it) and the next prompt runs normally."""
    server.run(free_vram_prompt())  # start with no kept models
    # 1024²: a step of the tiny model (about 0.15 s on two CPU cores) outlasts the interrupt's way from the
    # progress message back to the server; at its native 64² a step took about 25 ms in the server, and on
    # a busy machine three steps ran before the interrupt arrived. 200 steps: long enough to cancel.
    steps = 200
    prompt = basic_prompt(seed=51, steps=steps, keep_loaded=True, width=1024, height=1024)
    sampler = node_id(prompt, "PixArtQ_Sampler")
    cancelled_at: list[int] = []

    def cancel_after_two_steps(kind: str, data: dict) -> None:
        if kind == "progress" and data["node"] == sampler and data["value"] >= 2 and not cancelled_at:
            cancelled_at.append(data["value"])
            body = {"prompt_id": data["prompt_id"]}
            requests.post(server.url + "/interrupt", json=body, timeout=HTTP_TIMEOUT).raise_for_status()

    log_start = server.log.stat().st_size
    run = server.run(prompt, on_message=cancel_after_two_steps)
    assert cancelled_at, "the sampler reported no progress"
    assert run.status == "error" and run.error is None
    (interrupted,) = run.of_type("execution_interrupted")
    assert interrupted["node_id"] == sampler and interrupted["node_type"] == "PixArtQ_Sampler"
    done = max(data["value"] for data in run.of_type("progress") if data["node"] == sampler)
    # The step running when the interrupt arrives finishes; the check at the end of a step stops it.
    assert done <= cancelled_at[0] + 2 < steps
    assert node_id(prompt, "PixArtQ_VAEDecode") not in run.executed
    log = server.log_text(log_start)
    assert f"Interrupting prompt {run.prompt_id}" in log and "Processing interrupted" in log

    freed = server.run(free_vram_prompt())
    assert freed.text("free").startswith("dropped 0 kept model(s)")
    after = server.run(basic_prompt(seed=52))
    assert after.status == "success", after.error
    assert max(data["value"] for data in after.of_type("progress") if data["node"] == sampler) == STEPS
    (saved,) = after.outputs[node_id(prompt, "SaveImage")]["images"]
    assert (server.output / saved["subfolder"] / saved["filename"]).is_file()


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"denoise": 0.5}, "denoise 0.5 needs a latent"),
        ({"resolution": "1000x1000"}, "resolution '1000x1000' is not a preset"),
    ],
)
def test_sampling_choices_refused_when_queued(server, inputs, message):
    prompt = basic_prompt(**inputs)
    response = server.queue(prompt)
    assert response.status_code == 400
    errors = response.json()["node_errors"][node_id(prompt, "PixArtQ_Sampler")]["errors"]
    assert any(message in error["details"] for error in errors), errors


def test_width_not_a_multiple_of_16_is_refused_when_queued(server):
    # ComfyUI does not enforce an INT's step; the sampler's validate_inputs refuses it before T5 runs.
    prompt = basic_prompt(width=72)
    response = server.queue(prompt)
    assert response.status_code == 400
    errors = response.json()["node_errors"][node_id(prompt, "PixArtQ_Sampler")]["errors"]
    assert any("width 72 is not a multiple of 16; use 64 or 80" in error["details"] for error in errors), (
        errors
    )


def test_width_below_minimum_is_refused_at_validation(server):
    prompt = basic_prompt(width=8)
    response = server.queue(prompt)
    assert response.status_code == 400
    errors = response.json()["node_errors"][node_id(prompt, "PixArtQ_Sampler")]["errors"]
    assert any("width" in json.dumps(error) for error in errors), errors


def test_unsafe_filename_prefix_is_refused(server):
    prompt = basic_prompt()
    snapshot = node_id(prompt, "PixArtQ_MemorySnapshot")
    prompt[snapshot]["inputs"]["filename_prefix"] = "../evil"
    run = server.run(prompt)
    assert run.status == "error"
    assert run.error["node_id"] == snapshot and run.error["exception_type"] == "ValueError"
    assert "filename_prefix '../evil' is not allowed" in run.error["exception_message"]
    assert not list(server.base.rglob("evil*"))


def test_broken_then_deleted_model_folder(server):
    broken = "broken-pixart"
    shutil.copytree(server.models / MODEL, server.models / broken)
    shutil.rmtree(server.models / broken / "transformer")
    prompt = basic_prompt(model=broken)
    run = server.run(prompt)
    assert run.status == "error"
    assert run.error["node_type"] == "PixArtQ_Sampler"
    assert run.error["exception_type"] == "FileNotFoundError"
    assert broken in run.error["exception_message"] and "transformer/" in run.error["exception_message"]

    # The model list is read when the prompt is validated, so a deleted folder is refused up front.
    shutil.rmtree(server.models / broken)
    response = server.queue(prompt)
    assert response.status_code == 400
    assert broken in json.dumps(response.json()["node_errors"])


def test_kept_sampler_model_is_reused_then_freed(server):
    server.run(free_vram_prompt())  # start with no kept models
    first = server.run(basic_prompt(seed=11, keep_loaded=True))
    assert first.status == "success", first.error
    log_start = server.log.stat().st_size
    second = server.run(basic_prompt(seed=12, keep_loaded=True))
    assert second.status == "success", second.error
    assert "reusing kept model" in server.log_text(log_start)

    freed = server.run(free_vram_prompt())
    assert freed.status == "success", freed.error
    assert freed.text("free").startswith("dropped 1 kept model(s)")
    again = server.run(free_vram_prompt())
    assert again.text("free").startswith("dropped 0 kept model(s)")


TINY_T5_FILE = "tiny_t5xxl_fp16.safetensors"


@pytest.fixture(scope="module")
def t5_file(server) -> str:
    """A tiny T5 saved as one safetensors file (t5xxl's key layout) in the server's models/text_encoders,
    with T5-XXL's 32128 embeddings so that every id of ComfyUI's own tokenizer (32100) has one."""
    import torch
    from safetensors.torch import save_file
    from transformers import T5Config, T5EncoderModel

    from pixart_lowvram.cli.random_model import PRESETS

    torch.manual_seed(0)
    config = T5Config(
        **PRESETS["tiny"]["text_encoder"], vocab_size=32128, is_encoder_decoder=False, use_cache=False
    )
    state = T5EncoderModel(config).state_dict()
    del state["encoder.embed_tokens.weight"]  # tied to shared.weight; the t5xxl files hold only that
    folder = server.base / "models" / "text_encoders"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key: value.half().contiguous() for key, value in state.items()}, folder / TINY_T5_FILE)
    return TINY_T5_FILE


def test_single_file_t5_with_comfyuis_own_tokenizer(server, t5_file):
    """T5 from models/text_encoders with a PixArt folder that has neither text_encoder/ nor tokenizer/,
    and no complete PixArt folder to borrow them from: ComfyUI's own T5 tokenizer is used."""
    no_tokenizer = "pixart-without-t5"
    ignore = shutil.ignore_patterns("text_encoder", "tokenizer")
    shutil.copytree(server.models / MODEL, server.models / no_tokenizer, ignore=ignore)
    info = server.get("/object_info/PixArtQ_T5Encode")["PixArtQ_T5Encode"]
    options = info["input"]["optional"]["t5_file"][1]["options"]
    assert options[0] == "(from model)" and t5_file in options

    prompt = basic_prompt(model=no_tokenizer, seed=31)
    prompt[node_id(prompt, "PixArtQ_T5Encode")]["inputs"]["t5_file"] = t5_file
    log_start = server.log.stat().st_size
    # The complete tiny model would lend its tokenizer (as it lends T5 and the VAE to a 2K folder): it
    # steps out of models/diffusers for this prompt.
    aside = server.base / "aside"
    shutil.move(server.models / MODEL, aside)
    try:
        run = server.run(prompt)
    finally:
        shutil.move(aside, server.models / MODEL)
    assert run.status == "success", run.error
    log = server.log_text(log_start)
    assert "has no tokenizer/; using the T5 tokenizer in" in log
    assert str(Path("comfy") / "text_encoders" / "t5_tokenizer") in log
    (saved,) = run.outputs[node_id(prompt, "SaveImage")]["images"]
    with Image.open(server.output / saved["subfolder"] / saved["filename"]) as image:
        assert image.size == (SIZE, SIZE)


def test_a_text_encoder_file_that_is_not_t5_is_refused(server, t5_file):
    import torch
    from safetensors.torch import save_file

    clip = "clip_l_tiny.safetensors"
    save_file(
        {"text_model.final_layer_norm.weight": torch.ones(8)}, server.base / "models" / "text_encoders" / clip
    )
    prompt = basic_prompt(seed=32)
    encoder = node_id(prompt, "PixArtQ_T5Encode")
    prompt[encoder]["inputs"]["t5_file"] = clip
    run = server.run(prompt)
    assert run.status == "error"
    assert run.error["node_id"] == encoder and run.error["exception_type"] == "ValueError"
    assert f"t5_file '{clip}' is not a T5 encoder" in run.error["exception_message"]


def queue_command(server: ComfyServer, workflow: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m pixart_lowvram queue`` against the server, as a user runs it."""
    command = [sys.executable, "-m", "pixart_lowvram", "queue", str(workflow), "--server", server.url, *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=PROMPT_TIMEOUT, check=False, cwd=server.base
    )


# --set for the bundled API workflow: the tiny model at its native size, few steps.
TINY_SETS = [
    *(f"--set={key}.model={MODEL}" for key in ("1", "2", "3")),
    *(f"--set=2.{name}={value}" for name, value in (("width", SIZE), ("height", SIZE), ("steps", STEPS))),
]


def test_queue_command_runs_a_workflow_and_downloads_its_images(server, tmp_path):
    """The bundled API workflow, set to the tiny model from the command line, queued twice: two prompts
    with consecutive seeds, both images downloaded into --out."""
    out = tmp_path / "out"
    before = set(server.get("/history"))
    result = queue_command(
        server, API_WORKFLOW, *TINY_SETS, "--seed", "61", "--count", "2", "--out", str(out)
    )
    assert result.returncode == 0, result.stderr

    pngs = sorted(out.rglob("*.png"))
    assert len(pngs) == 2, result.stdout
    for png in pngs:
        assert str(png) in result.stdout
        with Image.open(png) as image:
            assert image.size == (SIZE, SIZE)
    history = server.get("/history")
    runs = [history[prompt_id] for prompt_id in set(history) - before]
    assert sorted(entry["prompt"][2]["2"]["inputs"]["seed"] for entry in runs) == [61, 62]
    assert all(entry["status"]["status_str"] == "success" for entry in runs)
    for entry in runs:
        assert f"prompt {entry['prompt'][1]}: 1 image(s)" in result.stdout


def test_queue_command_refuses_a_model_the_server_lacks(server, tmp_path):
    """The bundled workflow as shipped names PixArt-Sigma-XL-2-1024-MS, which this server does not have:
    the command says so, lists the models it has, and queues nothing."""
    before = set(server.get("/history"))
    result = queue_command(server, API_WORKFLOW, "--out", str(tmp_path / "out"))
    assert result.returncode != 0
    assert (
        "node 1 (PixArtQ_T5Encode) input 'model': 'PixArt-Sigma-XL-2-1024-MS' is not on the server"
        in result.stderr
    )
    available = result.stderr.split("available: ")[1].splitlines()[0].split(", ")
    assert MODEL in available and HUB_ID in available
    assert set(server.get("/history")) == before
    queue = server.get("/queue")
    assert queue["queue_running"] == [] and queue["queue_pending"] == []
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("assignment", "messages"),
    [
        # refused by POST /prompt: a 400 with node_errors
        ("2.width=72", ["node 2 (PixArtQ_Sampler): ", "width 72 is not a multiple of 16"]),
        # failed while running: execution_error in /history
        (
            "4.filename_prefix=../evil",
            ["failed in node 4 (PixArtQ_MemorySnapshot): ValueError: ", "filename_prefix '../evil'"],
        ),
    ],
)
def test_queue_command_exits_with_the_servers_error(server, tmp_path, assignment, messages):
    args = [*TINY_SETS, f"--set={assignment}", "--out", str(tmp_path / "out")]
    result = queue_command(server, API_WORKFLOW, *args)
    assert result.returncode == 2
    for message in messages:
        assert message in result.stderr


def test_encode_and_decode_drive_the_progress_bar(server):
    """T5 Encode and VAE Decode send progress when their model is loaded and when they are done."""
    prompt = basic_prompt(seed=41)
    # A prompt text of its own, so ComfyUI's cache cannot skip T5 Encode after an earlier test.
    prompt[node_id(prompt, "PixArtQ_T5Encode")]["inputs"]["prompt"] = "a lighthouse at dusk, progress test"
    run = server.run(prompt)
    assert run.status == "success", run.error
    for class_type in ("PixArtQ_T5Encode", "PixArtQ_VAEDecode"):
        node = node_id(prompt, class_type)
        progress = [(data["value"], data["max"]) for data in run.of_type("progress") if data["node"] == node]
        assert progress == [(1, 2), (2, 2)], (class_type, progress)
