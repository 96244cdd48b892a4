"""Shared fixtures for the CPU tier: one tiny random PixArt-Σ per session, an fp32 reference run, and
a spy on the stages' load functions (weak references to what they loaded)."""

from __future__ import annotations

import os

# Tests never download: the tiny model is built locally. huggingface_hub reads this at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gc
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pixart_lowvram.cli.random_model import build_random_pixart
from pixart_lowvram.core import (
    folders,
    quant_cache,
    sampler,
    sampler_settings,
    text_encoder,
    transformer_run,
    vae,
)
from pixart_lowvram.core.models import ModelSource, resolve_model
from pixart_lowvram.core.pool import cache, default_host_budget

PROMPT = "a photo of a red cat in a garden"
NEGATIVE = "dark"
# The tiny preset's transformer has sample_size 8: 64 px is its native size.
SIZE = 64
FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}


@pytest.fixture(scope="session", autouse=True)
def pack_home(tmp_path_factory: pytest.TempPathFactory):
    """Every folder the pack writes to of its own accord is under the session's temporary folder, for
    the tests and for the processes they start (which inherit the environment): the pack's home (the
    demo's random models), the pre-quantized weight cache (set too, over any the user's environment
    names), and matplotlib's caches (the memory timeline is drawn with it; ~/.cache and ~/.config
    otherwise). Nothing lands in the user's home: tests/test_cache_folders.py checks it."""
    home = tmp_path_factory.mktemp("pixart_lowvram_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(folders.HOME_ENV, str(home))
        patch.setenv(quant_cache.ENV, str(home / "quantized"))
        patch.setenv("MPLCONFIGDIR", str(tmp_path_factory.mktemp("matplotlib")))
        yield home


@pytest.fixture(scope="session", autouse=True)
def compiler_caches(tmp_path_factory: pytest.TempPathFactory):
    """torch.compile's caches and every temporary file are under the session's temporary folder (which a
    passing run deletes), for the tests and the processes they start (TMPDIR). Otherwise inductor keeps
    them in the system's temporary folder after the run: its cache in ``torchinductor_<user>``, and its
    precompiled headers (150 MB) in a folder it chose when it was imported, at collection, whatever
    TORCHINDUCTOR_CACHE_DIR says. Set over any the environment names."""
    from torch._inductor import codecache

    folder = tmp_path_factory.mktemp("torchinductor")
    scratch = tmp_path_factory.mktemp("tmp")
    headers = folder / "precompiled_headers"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
        patch.setenv("TRITON_CACHE_DIR", str(folder / "triton"))
        patch.setenv("TMPDIR", str(scratch))
        patch.setattr(tempfile, "tempdir", str(scratch))
        if hasattr(codecache, "_HEADER_DIR"):  # else tests/test_cache_folders.py fails, saying why
            patch.setattr(codecache, "_HEADER_DIR", str(headers))
            patch.setattr(codecache, "_HEADER_LOCK_DIR", str(headers / "locks"))
        yield folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random PixArt-Σ in the diffusers layout, built once per session."""
    return build_random_pixart(tmp_path_factory.mktemp("model") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny(tiny_folder: Path) -> ModelSource:
    return resolve_model(str(tiny_folder))


@pytest.fixture(scope="session")
def sdxl_vae_file(tmp_path_factory: pytest.TempPathFactory, tiny_folder: Path) -> Path:
    """The tiny model's VAE as one file in the original (ldm) key layout, as most ``sdxl_vae.safetensors``
    downloads are: ComfyUI's core VAELoader loads it (the tiny VAE has the real SDXL VAE's widths, the
    only architecture core builds for it) and its weights equal the tiny model's vae/."""
    from safetensors.torch import load_file, save_file
    from vae_layout import to_original_layout

    path = tmp_path_factory.mktemp("vae") / "sdxl_vae.safetensors"
    weights = load_file(tiny_folder / "vae" / "diffusion_pytorch_model.safetensors")
    save_file(to_original_layout(weights), path)
    return path


@pytest.fixture(scope="session")
def reference(tiny: ModelSource) -> SimpleNamespace:
    """The fp32, unquantized chain at the settings below; what quantized runs are measured against."""
    settings = {"width": SIZE, "height": SIZE, "steps": 2, "cfg": 4.5, "seed": 7}
    embeds = text_encoder.encode(text_encoder.EncoderSettings(tiny, **FP32), PROMPT, NEGATIVE)
    latents = sampler.sample(sampler_settings.SamplerSettings(tiny, **settings, **FP32), embeds)
    images = vae.decode(vae.DecoderSettings(tiny, device="cpu", precision=torch.float32), latents)
    return SimpleNamespace(
        prompt=PROMPT,
        negative=NEGATIVE,
        settings=settings,
        embeds=embeds,
        latents=latents,
        images=images,
    )


@pytest.fixture(autouse=True)
def _empty_model_cache():
    """Each test starts and ends with no kept models and no remembered embeddings, so keep_loaded tests
    cannot leak into others (only when there are some: clear() runs a full gc, which is slow with torch
    imported), and with the host-memory pool off, so a test sees each stage free its model; ``host_pool``
    turns the pool on."""
    budget, cache.host_budget = cache.host_budget, 0
    cache.forget_results()
    if len(cache) or cache.pooled():
        cache.clear()
    yield
    cache.forget_results()
    if len(cache) or cache.pooled():
        cache.clear()
    cache.host_budget = budget


@pytest.fixture
def host_pool() -> int:
    """The pool on, with its default budget (``_empty_model_cache`` restores it off, and empties it)."""
    cache.host_budget = default_host_budget()
    return cache.host_budget


@dataclass
class LoadSpy:
    """Weak references to every model the stages' ``_load`` functions returned, by stage."""

    loaded: dict[str, list[weakref.ref]] = field(default_factory=dict)

    def count(self, stage: str) -> int:
        return len(self.loaded.get(stage, []))

    def total(self) -> int:
        return sum(map(len, self.loaded.values()))

    def last(self, stage: str) -> weakref.ref:
        return self.loaded[stage][-1]

    def alive(self, stage: str) -> list[bool]:
        gc.collect()
        return [ref() is not None for ref in self.loaded.get(stage, [])]


@pytest.fixture
def load_spy(monkeypatch: pytest.MonkeyPatch) -> LoadSpy:
    """Wrap ``text_encoder._load``, ``transformer_run._load`` and ``vae._load`` (stages ``text_encoder``,
    ``transformer``, ``vae``); the wrappers keep only weak references."""
    spy = LoadSpy()
    for stage, module in (("text_encoder", text_encoder), ("transformer", transformer_run), ("vae", vae)):
        original = module._load

        def wrapper(*args, _original=original, _stage=stage, **kwargs):
            model = _original(*args, **kwargs)
            spy.loaded.setdefault(_stage, []).append(weakref.ref(model))
            return model

        monkeypatch.setattr(module, "_load", wrapper)
    return spy


class Graphs(list):
    """A torch.compile backend that runs each graph as dynamo traced it and keeps it (torch 2.13.0's CPU
    wheel cannot import inductor; the GPU tier compiles with inductor)."""

    def __call__(self, graph, example_inputs):
        self.append(graph)
        return graph.forward


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Graphs:
    """The graphs compiled blocks trace (:class:`Graphs` as the sampler's compile backend), dynamo's caches
    empty before and after."""
    traced = Graphs()
    monkeypatch.setattr(transformer_run, "COMPILE_BACKEND", traced)
    torch._dynamo.reset()
    yield traced
    torch._dynamo.reset()


@pytest.fixture
def fused_op_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each fused quantization op (core.quant.fused_kernels: quantize_rows,
    norm_modulate_quantize, gelu_quantize) was called; clear it to count afresh."""
    from pixart_lowvram.core.quant import fused_kernels

    counted: dict[str, int] = {}
    for name in ("quantize_rows", "norm_modulate_quantize", "gelu_quantize"):
        op = getattr(fused_kernels, name)

        def spy(*args, _op=op, _name=name, **kwargs):
            counted[_name] = counted.get(_name, 0) + 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(fused_kernels, name, spy)
    return counted


def comfyui_checkout_problem() -> str | None:
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return "set COMFYUI_PATH to a ComfyUI checkout to run the comfyui tier"
    if not (Path(path) / "main.py").is_file() or not (Path(path) / "comfy").is_dir():
        return f"COMFYUI_PATH={path!r} is not a ComfyUI checkout (no main.py and comfy/ there)"
    return None


def pytest_collection_modifyitems(config, items):
    """The comfyui tier needs a ComfyUI checkout named by COMFYUI_PATH; without one it is skipped."""
    problem = comfyui_checkout_problem()
    if problem is not None:
        skip = pytest.mark.skip(reason=problem)
        for item in items:
            if "comfyui" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny_folder):
    """A real ComfyUI server for the test module (the ``comfyui`` tier; see comfyui_support.py)."""
    from comfyui_support import running_server

    with running_server(request, tmp_path_factory.mktemp("comfyui"), tiny_folder) as started:
        yield started
