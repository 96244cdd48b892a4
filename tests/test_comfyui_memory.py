"""The pack next to ComfyUI's own models and memory manager, in a real ComfyUI server (the ``comfyui`` tier):
core VAE nodes on the pack's LATENT and the other way round, the SDXL VAE as a single file from models/vae,
kept models offloaded by ComfyUI's /free and its unload_all_models and dropped by Free VRAM; and in-process,
the pack's models as ComfyUI's own ModelPatchers under the version's real model_management.

The module's server (``running_server`` in comfyui_support.py) also holds the tiny model's VAE as
models/vae/sdxl_vae.safetensors (the ``sdxl_vae_file`` fixture: original key layout, same weights).
"""

from __future__ import annotations

import gc
import inspect
import itertools
import logging
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from comfyui_support import (
    HTTP_TIMEOUT,
    SDXL_VAE_FILE,
    Run,
    basic_prompt,
    node_id,
    running_server,
    wait_for_log,
)
from PIL import Image
from server_sequence import with_core_decode

pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)

# Both decoders run in float32 on the CPU; the saved PNGs may differ by one level where a value sits on
# a rounding boundary.
PNG_LEVELS = 1
TEXTS = itertools.count()


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny_folder, sdxl_vae_file):
    with running_server(
        request, tmp_path_factory.mktemp("comfyui"), tiny_folder, sdxl_vae_file=sdxl_vae_file
    ) as started:
        yield started


def saved_images(server, run: Run, node: str) -> list[np.ndarray]:
    """The images a SaveImage node wrote, as uint8 arrays."""
    assert run.status == "success", run.error
    images = run.outputs[node]["images"]
    return [
        np.asarray(Image.open(server.output / i["subfolder"] / i["filename"]).convert("RGB")) for i in images
    ]


def test_core_vae_decode_of_the_pack_latent_equals_the_pack_decode(server):
    prompt = basic_prompt(seed=5)
    save = node_id(prompt, "SaveImage")
    prompt[save]["inputs"]["filename_prefix"] = "pack_decode"
    run = server.run(with_core_decode(prompt, "core_decode"))
    (pack,) = saved_images(server, run, save)
    (core,) = saved_images(server, run, "core_save")
    assert pack.shape == core.shape == (64, 64, 3)
    assert pack.std() > 10, "the decode is flat: the comparison would prove nothing"
    difference = np.abs(pack.astype(int) - core.astype(int))
    assert difference.max() <= PNG_LEVELS, difference.max()


def pack_prompt(keep: bool = False, **sampler_inputs) -> dict:
    """The basic workflow without Memory Snapshot, with a text of its own (so T5 runs rather than coming
    from ComfyUI's cache); ``keep`` sets keep_loaded on all three model nodes."""
    prompt = basic_prompt(**sampler_inputs)
    prompt[node_id(prompt, "PixArtQ_T5Encode")]["inputs"]["prompt"] += f", {next(TEXTS)}"
    snapshot = node_id(prompt, "PixArtQ_MemorySnapshot")
    save = node_id(prompt, "SaveImage")
    prompt[save]["inputs"]["images"] = prompt.pop(snapshot)["inputs"]["value"]
    for node in prompt.values():
        if "keep_loaded" in node["inputs"]:
            node["inputs"]["keep_loaded"] = keep
    return prompt


LET_GO = re.compile(
    r"ComfyUI let go of the pack's nodes: dropped (\d+) kept model\(s\) and (\d+) from host memory"
)
FREED = re.compile(r"dropped (\d+) kept model\(s\)(?: and (\d+) from host memory)?")


def kept_count(server) -> int:
    """How many kept models a prompt of core nodes and Free VRAM drops (the count is the state before)."""
    return dropped(server)[0]


def dropped(server) -> tuple[int, int]:
    """The kept models and those waiting in host memory that a prompt of only core nodes and Free VRAM
    drops: as it starts, ComfyUI lets go of the pack's node objects and the pack of its models (the log
    says how many); Free VRAM drops what is left and says how many. The pack's T5 node is not in it: it
    would reuse a kept T5 with keep_loaded off (and drop it)."""
    prompt = {
        "empty": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "free": {"class_type": "PixArtQ_FreeVRAM", "inputs": {"value": ["empty", 0]}},
    }
    log_start = server.log.stat().st_size
    run = server.run(prompt)
    assert run.status == "success", run.error
    text = run.text("free")
    freed = FREED.match(text)
    assert freed, text
    kept, pooled = int(freed[1]), int(freed[2] or 0)
    for let_go in LET_GO.finditer(server.log_text(log_start)):
        kept, pooled = kept + int(let_go[1]), pooled + int(let_go[2])
    return kept, pooled


def test_pack_vae_decode_from_the_single_file_equals_the_model_folder(server):
    prompt = basic_prompt(seed=6)
    decode = node_id(prompt, "PixArtQ_VAEDecode")
    save = node_id(prompt, "SaveImage")
    prompt[save]["inputs"]["filename_prefix"] = "folder_vae"
    prompt["file_decode"] = {
        "class_type": "PixArtQ_VAEDecode",
        "inputs": prompt[decode]["inputs"] | {"vae_file": SDXL_VAE_FILE},
    }
    prompt["file_save"] = {
        "class_type": "SaveImage",
        "inputs": {"images": ["file_decode", 0], "filename_prefix": "file_vae"},
    }
    run = server.run(prompt)
    (folder,) = saved_images(server, run, save)
    (single,) = saved_images(server, run, "file_save")
    assert folder.std() > 10
    np.testing.assert_array_equal(single, folder)  # exact: the same weights bit for bit, the same decode


def test_pack_vae_decode_refuses_a_pickled_vae_file(server):
    (server.base / "models" / "vae" / "old_vae.pt").write_bytes(b"not read")
    prompt = basic_prompt()
    prompt[node_id(prompt, "PixArtQ_VAEDecode")]["inputs"]["vae_file"] = "old_vae.pt"
    run = server.run(prompt)
    assert run.status == "error"
    assert "only .safetensors files are read" in run.error["exception_message"]


def test_core_vae_encode_feeds_the_pack_sampler(server):
    """LoadImage → core VAEEncode (sdxl_vae.safetensors) → the pack's sampler at denoise 0.6: the image's
    size (128 × 64, not the sampler's 64²) and content carry through to the decoded result."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 128, 3), dtype=np.uint8)).save(
        server.base / "input" / "start.png"
    )
    outputs = {}
    for denoise in (0.6, 1.0):
        prompt = pack_prompt(seed=8, denoise=denoise)
        sampler = node_id(prompt, "PixArtQ_Sampler")
        save = node_id(prompt, "SaveImage")
        prompt[save]["inputs"]["filename_prefix"] = f"img2img_{denoise}"
        prompt |= {
            "load": {"class_type": "LoadImage", "inputs": {"image": "start.png"}},
            "core_vae": {"class_type": "VAELoader", "inputs": {"vae_name": SDXL_VAE_FILE}},
            "encode": {"class_type": "VAEEncode", "inputs": {"pixels": ["load", 0], "vae": ["core_vae", 0]}},
        }
        prompt[sampler]["inputs"]["latent"] = ["encode", 0]
        (outputs[denoise],) = saved_images(server, server.run(prompt), save)
    assert outputs[0.6].shape == (64, 128, 3)
    assert not np.array_equal(outputs[0.6], outputs[1.0]), "denoise < 1 ignored the encoded image"


def test_comfyui_free_endpoint_offloads_kept_models_and_the_next_prompt_reuses_them(server):
    """With keep_loaded on every node, two prompts; POST /free with unload_models (the front end's Unload
    Models) has ComfyUI unload the pack's models as its own (to its offload device: host memory), the
    prompt worker lives on, and a third prompt succeeds, reusing them."""
    kept_count(server)  # start with no kept models
    for seed in (21, 22):
        kept = server.run(with_core_decode(pack_prompt(keep=True, seed=seed), f"mixed_{seed}"))
        assert kept.status == "success", kept.error
    log_start = server.log.stat().st_size
    # The worker handles /free's flags when the queue wakes it; a /free that arrives while the worker is
    # still finishing the last prompt (not yet waiting) is seen only at its next wake-up, which may be
    # minutes away on an idle server. Each /free notifies the queue again, so asking again is the cure.
    for _attempt in range(6):
        response = requests.post(server.url + "/free", json={"unload_models": True}, timeout=HTTP_TIMEOUT)
        assert response.ok
        if wait_for_log(server, log_start, "ComfyUI moved pack model", 3, deadline_s=10):
            break
    assert server.log_text(log_start).count("ComfyUI moved pack model") == 3
    third = server.run(pack_prompt(keep=True, seed=23))
    assert third.status == "success", third.error
    assert server.log_text(log_start).count("reusing kept model") == 3
    assert "Traceback" not in server.log_text(log_start)
    assert kept_count(server) == 3


def test_a_second_prompt_takes_the_pack_models_back_from_host_memory(server):
    """keep_loaded off (the default): after each stage ComfyUI unloads the pack's model as one of its own,
    it waits in the pack's host-memory pool, and the next prompt — another text and seed — takes all three
    back instead of loading them again; Free VRAM then drops them from host memory."""
    kept_count(server)  # nothing kept, nothing waiting
    first = server.run(pack_prompt(seed=31))
    assert first.status == "success", first.error
    log_start = server.log.stat().st_size
    prompt = pack_prompt(seed=32)
    second = server.run(prompt)
    assert second.status == "success", second.error
    log = server.log_text(log_start)
    assert log.count("from host memory") == 3, log
    assert "Traceback" not in log
    assert saved_images(server, second, node_id(prompt, "SaveImage"))[0].shape == (64, 64, 3)
    assert dropped(server) == (0, 3)
    third = server.run(pack_prompt(seed=33))
    assert third.status == "success", third.error
    assert dropped(server) == (0, 3)  # loaded afresh, waiting again


def test_comfyui_free_endpoint_with_free_memory_releases_the_pack_models(server):
    """POST /free with free_memory (the front end's Free model and node cache) drops ComfyUI's node cache,
    and with the pack's node objects the pack lets go of its models: the kept VAE and the two waiting in
    host memory. The next prompt loads all three again."""
    dropped(server)  # nothing kept, nothing waiting
    prompt = pack_prompt(seed=41)
    prompt[node_id(prompt, "PixArtQ_VAEDecode")]["inputs"]["keep_loaded"] = True
    first = server.run(prompt)
    assert first.status == "success", first.error
    log_start = server.log.stat().st_size
    for _attempt in range(6):  # as in the test above: /free is seen when the worker wakes
        response = requests.post(
            server.url + "/free", json={"unload_models": True, "free_memory": True}, timeout=HTTP_TIMEOUT
        )
        assert response.ok
        if wait_for_log(server, log_start, "ComfyUI let go of the pack's nodes", 1, deadline_s=10):
            break
    log = server.log_text(log_start)
    assert [(int(kept), int(pooled)) for kept, pooled in LET_GO.findall(log)] == [(1, 2)], log
    again_start = server.log.stat().st_size
    again = server.run(pack_prompt(seed=42))
    assert again.status == "success", again.error
    log = server.log_text(again_start)
    assert "reusing model" not in log and "reusing kept model" not in log, log
    assert "Traceback" not in server.log_text(log_start)
    assert dropped(server) == (0, 3)


def test_free_vram_releases_every_kept_model(server):
    kept_count(server)
    run = server.run(pack_prompt(keep=True, seed=22))
    assert run.status == "success", run.error
    assert kept_count(server) == 3
    assert kept_count(server) == 0


def test_a_mixed_graph_with_kept_pack_models_runs_twice(server):
    """Core VAELoader/VAEDecode beside the pack's kept models: the second run reuses the pack's models and
    decodes the same image (a different seed for the core branch is not needed: same prompt, same seed)."""
    kept_count(server)
    prompt = with_core_decode(pack_prompt(keep=True, seed=23), "mixed_core")
    first = server.run(prompt)
    prompt["core_save"]["inputs"]["filename_prefix"] = "mixed_core_again"  # runs the graph's tail again
    log_start = server.log.stat().st_size
    second = server.run(prompt | {"2": prompt["2"] | {"inputs": prompt["2"]["inputs"] | {"seed": 24}}})
    assert second.status == "success", second.error
    assert "reusing kept model" in server.log_text(log_start)
    assert saved_images(server, first, "core_save")[0].shape == (64, 64, 3)
    assert kept_count(server) == 3


# In-process: ComfyUI's memory manager itself (comfy.model_management) with the pack's models in it.


@pytest.fixture
def comfy_mm(monkeypatch):
    """ComfyUI's model_management imported here (CPU only) with the pack's cache as its host; restores
    the cache's host and ComfyUI's list of loaded models."""
    monkeypatch.syspath_prepend(str(Path(os.environ["COMFYUI_PATH"]).resolve()))
    from comfy.cli_args import args

    monkeypatch.setattr(args, "cpu", True)
    import comfy.model_management as mm

    from pixart_lowvram.core.pool import cache
    from pixart_lowvram.nodes import comfy_models

    saved_host, saved_models = cache.host, list(mm.current_loaded_models)
    comfy_models.install(cache)
    try:
        yield mm
    finally:
        cache.clear()
        cache.host = saved_host
        mm.current_loaded_models[:] = saved_models


def use(key: str, keep: bool = True, device: str = "cpu", build=lambda: torch.nn.Linear(256, 256)):
    """One stage's use of a model through the pack's cache (key[0] names the stage, as the stages' keys do)."""
    from pixart_lowvram.core.pool import cache

    with cache.use(("transformer", key), build, keep=keep, device=torch.device(device)) as model:
        return model


def pack_entries(mm) -> list:
    from pixart_lowvram.nodes.comfy_models import PackModelPatcher

    return [entry for entry in mm.current_loaded_models if isinstance(entry.model, PackModelPatcher)]


def test_the_pack_models_are_comfyuis_own_loaded_models(comfy_mm):
    """Each model in use is a real ModelPatcher in a LoadedModel that load_models_gpu made (no look-alike
    of ComfyUI's classes); a kept one stays entered, one that is not kept leaves when the pack drops it."""
    import comfy.model_patcher

    use("kept"), use("not_kept", keep=False)
    gc.collect()
    (entry,) = pack_entries(comfy_mm)
    assert type(entry) is comfy_mm.LoadedModel
    assert isinstance(entry.model, comfy.model_patcher.ModelPatcher)
    assert entry.model.model_size() == entry.model.loaded_size() == 256 * 257 * 4


def test_the_pack_patcher_keeps_comfyuis_constructor_so_clone_works(comfy_mm, monkeypatch):
    """ComfyUI's ``clone()`` makes a patcher of the same class with ComfyUI's own constructor arguments, and
    0.38 adds one (``fast_disk``, which ``ModelPatcher.__init__`` and ``clone()`` take and pass): the pack's
    patcher keeps ComfyUI's constructor, so a clone on this version, and one made as 0.38's clone makes it
    (simulated: that constructor, a ``fast_disk`` keyword added), is a pack patcher of the same model."""
    import comfy.model_patcher

    from pixart_lowvram.nodes.comfy_models import PackModelPatcher

    assert PackModelPatcher.__init__ is comfy.model_patcher.ModelPatcher.__init__
    model = use("cloned")
    (entry,) = pack_entries(comfy_mm)
    patcher = entry.model
    assert patcher.key == ("transformer", "cloned") and patcher.inner is model
    clone = patcher.clone()
    assert type(clone) is PackModelPatcher and clone.inner is model
    assert clone.model_size() == patcher.model_size() and clone.host_copy is None

    comfy_init, seen = comfy.model_patcher.ModelPatcher.__init__, []

    def init_0_38(
        self, model, load_device, offload_device, size=0, weight_inplace_update=False, fast_disk=False
    ):
        seen.append(fast_disk)
        comfy_init(self, model, load_device, offload_device, size, weight_inplace_update)

    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "__init__", init_0_38)
    made = type(patcher)(
        patcher.model,
        patcher.load_device,
        patcher.offload_device,
        patcher.model_size(),
        weight_inplace_update=patcher.weight_inplace_update,
        fast_disk=True,
    )
    assert seen == [True] and type(made) is PackModelPatcher and made.inner is model
    assert made.model_size() == patcher.model_size()


def test_unload_all_models_offloads_kept_models_and_the_next_use_reloads_them(comfy_mm, caplog):
    from pixart_lowvram.core.pool import cache

    first, second = use("a"), use("b")
    assert len(pack_entries(comfy_mm)) == 2
    comfy_mm.unload_all_models()  # what POST /free with unload_models calls
    assert pack_entries(comfy_mm) == [] and len(cache) == 2  # offloaded, still in host memory
    with caplog.at_level(logging.INFO, logger="pixart_lowvram.core.pool"):
        assert use("a") is first
    assert "reusing kept model" in caplog.text
    (entry,) = pack_entries(comfy_mm)
    assert entry.model.inner is first and entry.model.loaded_size() > 0
    del second


def test_a_model_not_kept_is_unloaded_by_comfyui_and_waits_in_host_memory(comfy_mm, host_pool, caplog):
    """Not kept: after its stage ComfyUI unloads it as one of its own (out of current_loaded_models, to its
    offload device), the pack's pool holds it, and the next stage takes it back through load_models_gpu
    without building it again; a kept model beside it stays loaded; clearing the cache (Free VRAM) drops it."""
    from pixart_lowvram.core.pool import cache

    built = []

    def build():
        built.append(1)
        return torch.nn.Linear(256, 256)

    kept = use("kept")
    first = use("waiting", keep=False, build=build)
    assert [entry.model.inner for entry in pack_entries(comfy_mm)] == [kept]
    assert cache.pooled() == [("transformer", "waiting")]
    with caplog.at_level(logging.INFO, logger="pixart_lowvram.core.pool"):
        again = use("waiting", keep=False, build=build)
    assert again is first and built == [1]
    assert "from host memory" in caplog.text
    assert [entry.model.inner for entry in pack_entries(comfy_mm)] == [kept]
    cache.clear()
    assert cache.pooled() == []


class FakeQueue:
    """ComfyUI's PromptQueue as ModelNodeObjects reads it: the prompts running."""

    def __init__(self, *running: dict):
        self.running = [(index, f"prompt-{index}", prompt, {}, []) for index, prompt in enumerate(running)]

    def get_current_queue_volatile(self):
        return list(self.running), []


@pytest.fixture
def prompt_server(monkeypatch):
    """A stand-in for ComfyUI's ``server`` module: its PromptServer's queue, running nothing."""
    import types

    server = types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=None))
    server.PromptServer.instance = types.SimpleNamespace(prompt_queue=FakeQueue())
    monkeypatch.setitem(sys.modules, "server", server)
    return server.PromptServer.instance


def test_the_pack_lets_go_of_its_models_with_comfyuis_last_node_object(comfy_mm, host_pool, prompt_server):
    """The pack's models, kept or waiting in host memory, are held while ComfyUI holds a node object of the
    pack's model nodes: dropping one of two objects, or the last while a prompt with pack model nodes starts
    (their objects take over), keeps them; dropping the last between prompts (/free with free_memory) or
    as a prompt without them starts lets go of them."""
    from pixart_lowvram.core.pool import cache
    from pixart_lowvram.nodes import comfy_models
    from pixart_lowvram.nodes.sampler import QuantoPixArtSampler
    from pixart_lowvram.nodes.t5_encode import QuantizedT5Encode
    from pixart_lowvram.nodes.vae_decode import PixArtVAEDecode

    # The model nodes are those whose objects hold the models (their ids are written in both places).
    holders = (QuantizedT5Encode, QuantoPixArtSampler, PixArtVAEDecode)
    assert all(issubclass(cls, comfy_models.HoldsModels) for cls in holders)
    assert {cls.define_schema().node_id for cls in holders} == set(comfy_models.MODEL_NODES)

    def fill():
        use("kept")
        use("waiting", keep=False)
        assert (len(cache), cache.pooled()) == (1, [("transformer", "waiting")])

    assert comfy_models.MODEL_NODE_OBJECTS.alive == 0
    fill()
    encoder, sampler = QuantizedT5Encode(), QuantoPixArtSampler()
    assert comfy_models.MODEL_NODE_OBJECTS.alive == 2
    del encoder
    gc.collect()
    assert (len(cache), len(cache.pooled())) == (1, 1)  # the sampler's object holds them
    prompt_server.prompt_queue = FakeQueue({"7": {"class_type": "PixArtQ_VAEDecode", "inputs": {}}})
    del sampler
    gc.collect()
    assert (len(cache), len(cache.pooled())) == (1, 1)  # the starting prompt's pack nodes take over

    for running in ((), ({"1": {"class_type": "EmptyLatentImage", "inputs": {}}},)):
        prompt_server.prompt_queue = FakeQueue(*running)
        node = QuantizedT5Encode()
        fill()
        del node
        gc.collect()
        assert (len(cache), cache.pooled()) == (0, []), running
    assert comfy_models.MODEL_NODE_OBJECTS.alive == 0


def test_with_cache_none_no_model_waits_in_host_memory(comfy_mm, host_pool, monkeypatch):
    """--cache-none: ComfyUI keeps no node object between prompts, and the pack no model in host memory."""
    from comfy.cli_args import args

    from pixart_lowvram.core.pool import cache
    from pixart_lowvram.nodes import comfy_models

    monkeypatch.setattr(args, "cache_none", True)
    comfy_models.install(cache)
    use("waiting", keep=False)
    assert cache.host_budget == 0 and cache.pooled() == []


def test_comfyuis_own_calls_run_with_pack_models_loaded(comfy_mm):
    """Every model_management function that walks current_loaded_models (Dynamic VRAM's per-node
    reset_cast_buffers, pin eviction, the leak check, free_memory by size, unload_all_models) on the version
    in hand, with kept pack models in the list."""
    use("a"), use("b")
    cpu = torch.device("cpu")
    comfy_mm.cleanup_models_gc()
    comfy_mm.cleanup_models()
    for name, args in (("reset_cast_buffers", ()), ("free_pins", (1 << 30,)), ("free_ram", (1 << 30,))):
        function = getattr(comfy_mm, name, None)
        if function is not None:
            function(*args)
    comfy_mm.free_memory(0, cpu)
    assert len(pack_entries(comfy_mm)) == 2
    comfy_mm.free_memory(1e30, cpu)
    comfy_mm.unload_all_models()
    assert pack_entries(comfy_mm) == []


def test_quantized_weights_survive_offload_and_reload(comfy_mm):
    """bitsandbytes 4-bit (its quant_state) and optimum-quanto int8 (its scales) move whole with the model."""
    import bitsandbytes as bnb
    from optimum import quanto

    def build():
        linear4 = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32)
        linear4.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
        int8 = torch.nn.Sequential(torch.nn.Linear(64, 64))
        quanto.quantize(int8, weights=quanto.qint8)
        quanto.freeze(int8)
        return torch.nn.Sequential(linear4.to("cpu"), int8)

    model = use("quantized", build=build)
    x = torch.randn(2, 64)
    with torch.inference_mode():  # as the stages run
        expected, state = model(x), model[0].weight.quant_state
    comfy_mm.unload_all_models()
    again = use("quantized")
    assert again is model and model[0].weight.quant_state is state
    assert type(model[1][0].weight).__name__ == "WeightQBytesTensor"
    with torch.inference_mode():  # exact: the same tensors back (CPU only here), the same kernels
        assert torch.equal(again(x), expected)


def test_a_kept_model_counts_what_is_on_its_device(comfy_mm):
    """ComfyUI is told what unloading a kept model gives back on its device: all of a model kept whole,
    only the resident parts of a streamed one (its blocks wait in CPU memory). The meta device stands in
    for the GPU here."""
    from pixart_lowvram.core.streaming import bytes_on

    streamed = torch.nn.Sequential(torch.nn.Linear(256, 256, device="meta"), torch.nn.Linear(256, 256))
    assert bytes_on(streamed, torch.device("meta")) == 256 * 257 * 4
    assert bytes_on(streamed, torch.device("cpu")) == 256 * 257 * 4
    assert bytes_on(torch.nn.Linear(256, 256), torch.device("meta")) == 0


def test_room_for_a_core_model_offloads_kept_models_on_its_device(comfy_mm, monkeypatch):
    """free_memory(needed, device), as load_models_gpu calls it for a core model, offloads kept models on
    that device until enough is free (a GPU is simulated: its free memory is what the test says; the
    models never really move there)."""
    gpu = torch.device("cuda", 0)
    free = 10

    def fake_free(dev=None, torch_free_too=False):
        return (free, free) if torch_free_too else free

    monkeypatch.setattr(comfy_mm, "get_free_memory", fake_free)
    use("on_gpu", device=gpu), use("on_cpu")
    comfy_mm.free_memory(5, gpu)  # enough already free: nothing offloaded
    assert sorted(str(e.device) for e in pack_entries(comfy_mm)) == ["cpu", "cuda:0"]
    comfy_mm.free_memory(1000, gpu)
    assert [str(e.device) for e in pack_entries(comfy_mm)] == ["cpu"]


def test_a_stage_asks_comfyui_for_room_before_loading_and_loads_through_it(comfy_mm, monkeypatch):
    from pixart_lowvram.core.pool import cache

    asked, placed = [], []
    dynamic = (
        {"for_dynamic": True} if "for_dynamic" in inspect.signature(comfy_mm.free_memory).parameters else {}
    )
    monkeypatch.setattr(
        comfy_mm,
        "free_memory",
        lambda needed, device, *args, **kwargs: asked.append((needed, device, kwargs)),
    )
    original = comfy_mm.load_models_gpu

    def load_models_gpu(models, memory_required=0, **kwargs):
        placed.append((memory_required, kwargs.get("force_full_load")))
        return original(models, memory_required=memory_required, **kwargs)

    monkeypatch.setattr(comfy_mm, "load_models_gpu", load_models_gpu)
    monkeypatch.setattr(
        comfy_mm,
        "get_free_memory",
        lambda dev=None, torch_free_too=False: (1 << 40, 1 << 40) if torch_free_too else 1 << 40,
    )
    gpu = torch.device("cuda", 0)
    for keep in (True, False):
        with cache.use(
            ("vae", "stage"),
            lambda: torch.nn.Linear(2, 2),
            keep=keep,
            device=gpu,
            weights=3 << 30,
            work=1 << 30,
        ):
            pass
    reserve = comfy_mm.extra_reserved_memory()
    # A fresh load makes room for weights and work; the kept model's second run only needs its work,
    # which load_models_gpu makes room for.
    assert [a for a in asked if a[0] == (4 << 30) + reserve] == [((4 << 30) + reserve, gpu, dynamic)]
    assert placed == [(1 << 30, True), (1 << 30, True)]
