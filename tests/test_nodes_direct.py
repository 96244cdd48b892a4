"""The nodes called in-process the way ComfyUI's executor calls them (the ``comfyui`` tier): the class
cloned with its hidden inputs, ``execute`` run inside the prompt's executing context, on the tiny model.

Needs COMFYUI_PATH (a ComfyUI checkout). It is on sys.path only while the module's ``comfy`` fixture is
active; ComfyUI's modules, once imported, stay in sys.modules as in ComfyUI's own unit tests.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pixart_lowvram.core import measure, text_encoder, transformer_run, vae
from pixart_lowvram.core.contract import PixArtEmbeds
from pixart_lowvram.core.pool import cache

MODEL = "tiny-pixart"
SIZE, STEPS = 64, 3
NODE_IDS = {
    "PixArtQ_T5Encode",
    "PixArtQ_Sampler",
    "PixArtQ_VAEDecode",
    "PixArtQ_FreeVRAM",
    "PixArtQ_MemorySnapshot",
    "PixArtQ_ModelLoader",
    "PixArtQ_LoRA",
    "PixArtQ_BatchedGuidance",
}


pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)


@pytest.fixture(scope="module")
def comfy(tmp_path_factory, tiny_folder):
    """ComfyUI importable (CPU only), its diffusers folder holding the tiny model and its output folder
    a temporary one; the pack's nodes as its entry point lists them. Restores sys.path and the folders."""
    saved_path = list(sys.path)
    sys.path.insert(0, str(Path(os.environ["COMFYUI_PATH"]).resolve()))
    try:
        # Outside main.py ComfyUI does not parse the command line; its own unit tests set the flag.
        from comfy.cli_args import args

        saved_cpu, args.cpu = args.cpu, True
        import comfy.utils
        import folder_paths
        from comfy_api.latest import io
        from comfy_execution.utils import CurrentNodeContext

        import pixart_lowvram

        models = tmp_path_factory.mktemp("comfy_models")
        (models / MODEL).symlink_to(tiny_folder, target_is_directory=True)
        output = tmp_path_factory.mktemp("comfy_output")
        saved_output = folder_paths.get_output_directory()
        saved_diffusers = folder_paths.folder_names_and_paths["diffusers"]
        folder_paths.folder_names_and_paths["diffusers"] = ([str(models)], set(saved_diffusers[1]))
        folder_paths.set_output_directory(str(output))
        try:
            extension = asyncio.run(pixart_lowvram.comfy_entrypoint())
            node_list = asyncio.run(extension.get_node_list())
            yield SimpleNamespace(
                io=io,
                utils=comfy.utils,
                context=CurrentNodeContext,
                nodes={node.GET_SCHEMA().node_id: node for node in node_list},
                output=output,
            )
        finally:
            folder_paths.set_output_directory(saved_output)
            folder_paths.folder_names_and_paths["diffusers"] = saved_diffusers
            args.cpu = saved_cpu
    finally:
        sys.path[:] = saved_path


class Prompt:
    """One prompt's worth of node calls: hidden inputs and executing context as ComfyUI sets them."""

    def __init__(self, comfy, graph: dict):
        self.comfy, self.graph, self.id = comfy, graph, f"direct-{uuid.uuid4()}"

    def call(self, node_id: str, **inputs):
        node = self.comfy.nodes[self.graph[node_id]["class_type"]]
        from comfy_execution.graph import DynamicPrompt

        hidden = {
            self.comfy.io.Hidden.dynprompt: DynamicPrompt(self.graph),
            self.comfy.io.Hidden.unique_id: node_id,
        }
        # v0.8 on take ComfyUI's V3Data ({"hidden_inputs": …}); v0.3.64 the hidden inputs themselves.
        takes_v3_data = "v3_data" in inspect.signature(node.PREPARE_CLASS_CLONE).parameters
        clone = node.PREPARE_CLASS_CLONE({"hidden_inputs": hidden} if takes_v3_data else hidden)
        with self.comfy.context(self.id, node_id):
            return clone.execute(**inputs)


GRAPH = {
    "1": {"class_type": "PixArtQ_T5Encode", "inputs": {}},
    "2": {"class_type": "PixArtQ_Sampler", "inputs": {"embeds": ["1", 0]}},
    "3": {"class_type": "PixArtQ_VAEDecode", "inputs": {"latent": ["2", 0]}},
    "4": {"class_type": "PixArtQ_MemorySnapshot", "inputs": {"value": ["3", 0], "filename_prefix": "direct"}},
}


def sampler_inputs(embeds, **overrides) -> dict:
    inputs = {
        "model": MODEL,
        "embeds": embeds,
        "width": SIZE,
        "height": SIZE,
        "steps": STEPS,
        "cfg": 4.5,
        "seed": 0,
        "batch_size": 1,
        "quantization": "qint8",
        "keep_loaded": False,
    }
    return {**inputs, **overrides}


class ProgressHook:
    """ComfyUI's progress bar hook while the ``with`` lasts: records (value, total, preview) per call
    and runs ``also`` on each."""

    def __init__(self, comfy, also=None):
        self.utils, self.also, self.calls = comfy.utils, also, []

    def __call__(self, value, total, preview, node_id=None):
        self.calls.append((value, total, preview))
        if self.also is not None:
            self.also(value)

    # ComfyUI's own throttle of the hook (about v0.30 on: first, last, and others 0.1 s and 0.5 % apart)
    # is off while the hook records, so it sees every update the pack makes.
    THROTTLE = {"PROGRESS_THROTTLE_MIN_INTERVAL": 0.0, "PROGRESS_THROTTLE_MIN_PERCENT": 0.0}

    def __enter__(self):
        self.saved = self.utils.PROGRESS_BAR_HOOK
        self.saved_throttle = {
            name: getattr(self.utils, name) for name in self.THROTTLE if hasattr(self.utils, name)
        }
        for name in self.saved_throttle:
            setattr(self.utils, name, self.THROTTLE[name])
        self.utils.set_progress_bar_global_hook(self)
        return self

    def __exit__(self, *exc_info):
        self.utils.set_progress_bar_global_hook(self.saved)
        for name, value in self.saved_throttle.items():
            setattr(self.utils, name, value)


@pytest.fixture(scope="module")
def chain(comfy):
    """T5 encode -> sampler -> decode through the nodes in one prompt, with ComfyUI's progress hook
    recording each node's progress."""
    prompt = Prompt(comfy, GRAPH)
    with ProgressHook(comfy) as encode_hook:
        embeds = prompt.call(
            "1",
            model=MODEL,
            prompt="a photo of a red cat",
            negative_prompt="",
            quantization="nf4",
            keep_loaded=False,
        ).result[0]
    with ProgressHook(comfy) as hook:
        latent = prompt.call("2", **sampler_inputs(embeds)).result[0]
    with ProgressHook(comfy) as decode_hook:
        images = prompt.call("3", model=MODEL, latent=latent, keep_loaded=False).result[0]
    steps = [(value, total) for value, total, _preview in hook.calls]
    previews = [preview for _value, _total, preview in hook.calls]
    return SimpleNamespace(
        prompt=prompt,
        embeds=embeds,
        latent=latent,
        images=images,
        steps=steps,
        previews=previews,
        encode_progress=encode_hook.calls,
        decode_progress=decode_hook.calls,
    )


def test_entry_point_lists_the_nodes(comfy):
    assert set(comfy.nodes) == NODE_IDS
    assert len({node.GET_SCHEMA().category for node in comfy.nodes.values()}) == 1


def test_model_list_shows_the_diffusers_folder(comfy):
    schema = comfy.nodes["PixArtQ_Sampler"].GET_SCHEMA()
    (model,) = [i for i in schema.inputs if i.id == "model"]
    assert MODEL in model.options


def test_chain_outputs(chain):
    assert isinstance(chain.embeds, PixArtEmbeds)
    assert chain.embeds.prompt_embeds.device.type == "cpu"
    samples = chain.latent["samples"]
    assert list(chain.latent) == ["samples"]
    assert samples.dtype == torch.float32 and samples.device.type == "cpu"
    assert samples.shape == (1, 4, SIZE // 8, SIZE // 8)
    images = chain.images
    assert images.dtype == torch.float32 and images.device.type == "cpu"
    assert images.shape == (1, SIZE, SIZE, 3)
    assert images.min() >= 0.0 and images.max() <= 1.0


def test_sampler_drives_comfyui_progress_bar(chain):
    assert chain.steps == [(step, STEPS) for step in range(1, STEPS + 1)]


def test_encode_and_decode_report_loaded_and_done(chain):
    assert chain.encode_progress == [(1, 2, None), (2, 2, None)]
    assert chain.decode_progress == [(1, 2, None), (2, 2, None)]


@pytest.fixture
def latent2rgb_previews(comfy):
    """``--preview-method latent2rgb`` for one test (outside main.py nothing parses the command line)."""
    from comfy.cli_args import LatentPreviewMethod, args

    saved, args.preview_method = args.preview_method, LatentPreviewMethod.Latent2RGB
    yield
    args.preview_method = saved


def test_no_previews_by_default(chain):
    # ComfyUI's --preview-method defaults to none.
    assert chain.previews == [None] * STEPS


def test_sampler_previews_its_latents_in_comfyuis_model_space(comfy, chain, latent2rgb_previews):
    """Each step hands the progress hook a preview from ComfyUI's previewer for the SDXL format; the last
    is that previewer's image of the returned LATENT taken into the model space (process_in, × 0.13025),
    where ComfyUI's previewers work. The random model's latents grow huge over a whole schedule and
    saturate every preview, so this runs the last few low-noise steps from a latent of a real image's
    magnitude (raw VAE space, so about 1 in the model space), where the space makes a difference."""
    import latent_preview
    import numpy as np
    from comfy.latent_formats import SDXL

    sdxl = SDXL()
    start = torch.randn((1, 4, SIZE // 8, SIZE // 8), generator=torch.Generator().manual_seed(0))
    inputs = sampler_inputs(chain.embeds, steps=20, latent={"samples": start * 0.5 / sdxl.scale_factor})
    with ProgressHook(comfy) as hook:
        latent = Prompt(comfy, GRAPH).call("2", **inputs, denoise=0.1).result[0]
    assert [(value, total) for value, total, _preview in hook.calls] == [(1, 2), (2, 2)]
    for _value, _total, preview in hook.calls:
        kind, image, max_size = preview
        assert kind == "JPEG" and max_size == latent_preview.MAX_PREVIEW_RESOLUTION
        assert image.size == (SIZE // 8, SIZE // 8)

    previewer = latent_preview.Latent2RGBPreviewer(sdxl.latent_rgb_factors, sdxl.latent_rgb_factors_bias)
    shown = np.asarray(hook.calls[-1][2][1], dtype=int)
    in_model_space = previewer.decode_latent_to_preview(sdxl.process_in(latent["samples"]))
    raw = previewer.decode_latent_to_preview(latent["samples"])
    assert ((shown > 0) & (shown < 255)).mean() > 0.5, "a saturated preview cannot tell the spaces apart"
    # The pipeline's bf16 latents against float32 ones, truncated to uint8.
    assert np.abs(shown - np.asarray(in_model_space, dtype=int)).max() <= 1
    assert np.abs(shown - np.asarray(raw, dtype=int)).mean() > 32


def test_cancel_stops_the_sampler_at_the_next_step_and_frees_it(comfy, chain, load_spy):
    """ComfyUI's interrupt flag set during step 2 (as POST /interrupt does) stops sampling when step 3
    ends: the pack's check raises ComfyUI's InterruptProcessingException, and the transformer is gone
    although keep_loaded asked to keep it."""
    from comfy import model_management

    def interrupt_at_step_two(value):
        if value == 2:
            model_management.interrupt_current_processing()

    with (
        ProgressHook(comfy, also=interrupt_at_step_two) as hook,
        pytest.raises(model_management.InterruptProcessingException),
    ):
        Prompt(comfy, GRAPH).call("2", **sampler_inputs(chain.embeds, steps=10, keep_loaded=True))
    assert [value for value, _total, _preview in hook.calls] == [1, 2]
    assert not model_management.processing_interrupted()
    assert load_spy.alive("transformer") == [False]
    assert len(cache) == 0


def test_memory_report_collects_the_prompt_stages(chain):
    stages = measure.reports.get(chain.prompt.id).stages
    assert [stage.stage for stage in stages] == ["t5_encode", "sample", "vae_decode"]
    assert all(stage.device == "cpu" and stage.error is None for stage in stages)


@pytest.fixture
def no_drawing(monkeypatch):
    """The timeline picture fails when drawn (matplotlib is not to be used)."""
    from pixart_lowvram.core import timeline

    def draw(*args, **kwargs):
        raise AssertionError("the timeline picture was drawn")

    monkeypatch.setattr(timeline.Timeline, "picture", draw)


def test_memory_snapshot_writes_its_record_to_the_output_folder(comfy, chain, no_drawing):
    """allocator_history off (the default) and the timeline output unlinked: the table only, fast."""
    start = time.perf_counter()
    out = chain.prompt.call("4", value=chain.images, filename_prefix="direct")
    seconds = time.perf_counter() - start
    assert out.result[0] is chain.images
    placeholder = out.result[1]
    assert placeholder.shape == (1, 64, 64, 3) and not placeholder.any()
    (text,) = out.ui["text"]  # a plain dict
    assert "images" not in out.ui, "no picture on the node"
    assert "no CUDA" in text and "vae_decode" in text and "not asked for" in text
    record = comfy.output / "direct_00001.json"
    assert sorted(p.name for p in comfy.output.glob("direct_*")) == ["direct_00001.json", "direct_00001.md"]
    assert record.name in text
    stages = [stage["stage"] for stage in json.loads(record.read_text())["stages"]]
    assert stages == ["t5_encode", "sample", "vae_decode"]
    assert seconds < 0.5, seconds  # next to nothing; generous for a loaded machine


def test_memory_snapshot_draws_when_its_timeline_is_linked(comfy, chain):
    graph = {
        **GRAPH,
        "5": {"class_type": "SaveImage", "inputs": {"images": ["4", 1], "filename_prefix": "timeline"}},
    }
    graph["4"] = {**GRAPH["4"], "inputs": {**GRAPH["4"]["inputs"], "filename_prefix": "linked"}}
    prompt = Prompt(comfy, graph)
    prompt.id = chain.prompt.id  # the chain's stages
    out = prompt.call("4", value=chain.images, filename_prefix="linked")
    timeline = out.result[1]
    assert timeline.ndim == 4 and timeline.shape[0] == 1 and timeline.shape[1:] == (500, 1000, 3)
    assert out.ui["images"], "the timeline is shown on the node"
    (text,) = out.ui["text"]
    assert sorted(p.name for p in comfy.output.glob("linked_*")) == [
        "linked_00001.json",
        "linked_00001.md",
        "linked_00001.png",
    ]
    assert "linked_00001.png" in text


def test_memory_snapshot_draws_with_allocator_history(comfy, chain):
    out = chain.prompt.call("4", value=chain.images, filename_prefix="history", allocator_history=True)
    assert out.result[1].shape[1:] == (500, 1000, 3) and out.ui["images"]
    (text,) = out.ui["text"]
    names = sorted(p.name for p in comfy.output.glob("history_*"))
    expected = ["history_00001.json", "history_00001.md", "history_00001.png"]
    if torch.cuda.is_available():
        assert "history_00001.pickle" in names
    else:
        assert names == expected and "no CUDA" in text


@pytest.mark.parametrize(
    ("snapshot_inputs", "asked"),
    [
        (None, False),  # no Memory Snapshot node
        ({}, False),  # saved before allocator_history: the default, off
        ({"allocator_history": False}, False),
        ({"allocator_history": True}, True),
        ({"allocator_history": ["9", 0]}, True),  # linked: read only when it runs, so taken as asked
    ],
)
def test_begin_stage_records_the_history_only_when_asked(comfy, monkeypatch, snapshot_inputs, asked):
    from comfy_execution.graph import DynamicPrompt

    from pixart_lowvram.nodes import common

    calls = []
    monkeypatch.setattr(measure.history, "ensure", lambda run_id: calls.append(run_id) or True)
    monkeypatch.setattr(measure.history, "stop", lambda: calls.append("stop"))
    graph = {"1": {"class_type": "PixArtQ_T5Encode", "inputs": {}}}
    if snapshot_inputs is not None:
        inputs = {"value": ["1", 0], "filename_prefix": "x", **snapshot_inputs}
        graph["4"] = {"class_type": "PixArtQ_MemorySnapshot", "inputs": inputs}
    with comfy.context("prompt-1", "1"):
        common.begin_stage(DynamicPrompt(graph))
    assert calls == (["prompt-1"] if asked else ["stop"])


def test_memory_snapshot_refuses_a_prefix_outside_the_output_folder(comfy, chain):
    with pytest.raises(ValueError, match=r"filename_prefix '\.\./evil' is not allowed"):
        chain.prompt.call("4", value=chain.images, filename_prefix="../evil")
    assert not list(comfy.output.parent.glob("evil*"))


def test_free_vram_passes_its_input_through(comfy):
    value = object()
    out = Prompt(comfy, {"9": {"class_type": "PixArtQ_FreeVRAM", "inputs": {}}}).call("9", value=value)
    assert out.result[0] is value
    (text,) = out.ui.as_dict()["text"]
    assert text.startswith("dropped 0 kept model(s)")
    assert ("no CUDA" in text) is not torch.cuda.is_available()


def test_free_vram_drops_a_kept_sampler_model(comfy, chain):
    prompt = Prompt(comfy, GRAPH)
    prompt.call("2", **sampler_inputs(chain.embeds, keep_loaded=True))
    assert len(cache) == 1
    out = Prompt(comfy, {"9": {"class_type": "PixArtQ_FreeVRAM", "inputs": {}}}).call("9", value=chain.latent)
    assert out.result[0] is chain.latent
    assert out.ui.as_dict()["text"][0].startswith("dropped 1 kept model(s)")
    assert len(cache) == 0


def test_sampler_resolution_preset_sets_the_size(comfy, chain):
    inputs = sampler_inputs(chain.embeds, width=72, resolution="512: 1024×256 (4.00:1)", steps=1)
    latent = Prompt(comfy, GRAPH).call("2", **inputs).result[0]
    assert latent["samples"].shape == (1, 4, 256 // 8, 1024 // 8)


def test_sampler_takes_a_latent_and_gives_a_latent(comfy, chain):
    prompt = Prompt(comfy, GRAPH)
    inputs = sampler_inputs(chain.embeds, batch_size=2, scheduler="euler_ancestral", latent=chain.latent)
    out = prompt.call("2", **inputs, denoise=0.5).result[0]
    assert list(out) == ["samples"] and out["samples"].shape == (2, 4, SIZE // 8, SIZE // 8)
    unchanged = prompt.call("2", **inputs, denoise=0.0).result[0]["samples"]
    assert torch.equal(unchanged, chain.latent["samples"].repeat(2, 1, 1, 1))


@pytest.mark.parametrize(
    ("inputs", "verdict"),
    [
        ({}, True),
        ({"width": 72}, "width 72 is not a multiple of 16; use 64 or 80"),
        ({"width": 72, "latent": None}, True),  # linked: the latent sets the size
        ({"width": 72, "resolution": "1024: 1024×1024 (1:1)"}, True),
        ({"resolution": "1000x1000"}, "resolution '1000x1000' is not a preset"),
        ({"denoise": 0.5}, "denoise 0.5 needs a latent"),
        ({"denoise": 0.5, "latent": None}, True),
        ({"denoise": 1.5, "latent": None}, "denoise 1.5 is out of range"),
    ],
)
def test_sampler_validates_when_queued(comfy, inputs, verdict):
    result = comfy.nodes["PixArtQ_Sampler"].validate_inputs(**{"width": SIZE, "height": SIZE, **inputs})
    assert result is True if verdict is True else verdict in result


def test_vae_node_takes_the_old_model_folder_choice(comfy, chain, monkeypatch):
    """Workflows saved when vae_file's "(from model)" was called "(model folder)" pass validation and
    decode with the model's own vae/, as "(from model)" does."""
    from pixart_lowvram.nodes.common import FROM_MODEL

    node = comfy.nodes["PixArtQ_VAEDecode"]
    assert node.validate_inputs(vae_file="(model folder)") is True
    assert node.validate_inputs(vae_file=FROM_MODEL) is True
    assert isinstance(node.validate_inputs(vae_file="not-a-vae.safetensors"), str)
    asked = []
    original = vae._load

    def spy(settings):
        asked.append(settings.vae_file)
        return original(settings)

    monkeypatch.setattr(vae, "_load", spy)
    out = Prompt(comfy, GRAPH).call(
        "3", model=MODEL, latent=chain.latent, keep_loaded=False, vae_file="(model folder)"
    )
    assert asked == [None], "the model's own VAE, no file"
    assert torch.equal(out.result[0], chain.images)


@pytest.mark.parametrize(("node_id", "module"), [("1", text_encoder), ("2", transformer_run), ("3", vae)])
def test_out_of_memory_in_a_node_says_how_to_free_vram_in_comfyui(comfy, chain, monkeypatch, node_id, module):
    """Core's advice says to free the memory other models hold; the node adds how, in ComfyUI."""

    def out_of_memory(*_settings):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(module, "_load", out_of_memory)
    inputs = {
        "1": {
            "model": MODEL,
            "prompt": "a cat",
            "negative_prompt": "",
            "quantization": "nf4",
            "keep_loaded": False,
        },
        "2": sampler_inputs(chain.embeds),
        "3": {"model": MODEL, "latent": chain.latent, "keep_loaded": False},
    }[node_id]
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        Prompt(comfy, GRAPH).call(node_id, **inputs)
    message = str(info.value)
    for part in ("ran out of GPU memory", "free the GPU memory other models hold", "Free VRAM"):
        assert part in message, f"{part!r} not in: {message}"
    assert len(cache) == 0


def test_the_model_loaders_auto_may_take_the_cards_8bit_path(comfy, monkeypatch):
    """The int8 Model Loader's ``auto`` takes the card's measured 8-bit path as the sampler's does (a LoRA
    runs in the 8-bit weights, quantized again once a run)."""
    from pixart_lowvram.core.quant import compute as compute_paths

    asked = []
    resolve = compute_paths.resolve
    monkeypatch.setattr(
        compute_paths,
        "resolve",
        lambda compute, device, scheme, eight_bit=False: (
            asked.append((compute, eight_bit)) or resolve(compute, device, scheme, eight_bit)
        ),
    )
    graph = {"1": {"class_type": "PixArtQ_ModelLoader", "inputs": {}}}
    model = Prompt(comfy, graph).call("1", model=MODEL, quantization="qint8").result[0]
    assert asked == [("auto", True)]
    assert model.model.diffusion_model is not None
