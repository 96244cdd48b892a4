"""The pack's forwards run attention in torch's own backend order for the GPU (core/devices.py), whatever
order an earlier priority context (ComfyUI's, around each of its attention calls) left behind."""

from __future__ import annotations

import pytest
import torch
from conftest import FP32
from torch.nn.attention import SDPBackend, sdpa_kernel

from pixart_lowvram.core import devices, sampler

CUDNN_FIRST = [int(getattr(SDPBackend, name)) for name in devices.CUDNN_FIRST]
# What ComfyUI v0.33's own context restores after its first call: torch's default, FlashAttention first.
FLASH_FIRST = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
    SDPBackend.CUDNN_ATTENTION,
]


def order() -> list[int]:
    return list(torch._C._get_sdp_priority_order())[: len(CUDNN_FIRST)]


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of the given compute capability and cuDNN version, as torch reports them."""

    def make(capability: tuple[int, int], cudnn: int = 91900) -> torch.device:
        devices.prefers_cudnn_attention.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: capability)
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
        return torch.device("cuda")

    yield make
    devices.prefers_cudnn_attention.cache_clear()


@pytest.mark.parametrize(
    ("capability", "cudnn", "prefers"),
    [
        ((9, 0), 91900, True),
        ((10, 0), 91900, True),
        ((9, 0), 91400, False),
        ((8, 9), 91900, False),
        ((8, 6), 91900, False),
    ],
)
def test_torch_prefers_cudnn_on_hopper_and_blackwell_with_a_recent_cudnn(gpu, capability, cudnn, prefers):
    assert devices.prefers_cudnn_attention(gpu(capability, cudnn)) is prefers


def test_the_order_is_cudnn_first_inside_and_restored_after(gpu):
    device = gpu((9, 0))
    with sdpa_kernel(FLASH_FIRST, set_priority=True):
        before = order()
        with devices.attention_order(device):
            assert order() == CUDNN_FIRST
        assert order() == before


def test_a_cross_attention_inside_runs_flashattention_first_and_restores_cudnn_first(gpu):
    device = gpu((9, 0))
    short_keys_first = [int(getattr(SDPBackend, name)) for name in devices.SHORT_KEYS_FIRST]
    with sdpa_kernel(FLASH_FIRST, set_priority=True):
        before = order()
        with devices.attention_order(device):
            with devices.cross_attention_order(device):
                assert order() == short_keys_first
            assert order() == CUDNN_FIRST
        assert order() == before
        with devices.cross_attention_order(gpu((8, 9))):  # FlashAttention first already: left as it is
            assert order() == before


def test_elsewhere_the_order_is_left_as_it_is(gpu, monkeypatch):
    with sdpa_kernel(FLASH_FIRST, set_priority=True):
        before = order()
        with devices.attention_order(gpu((8, 9))):
            assert order() == before
        with devices.attention_order(torch.device("cpu")):
            assert order() == before
        monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
        with devices.attention_order(gpu((9, 0))):
            assert order() == before


def test_the_pack_sampler_runs_its_attention_in_that_order(tiny, reference, monkeypatch):
    """Every attention call of the Quanto PixArt Sampler's transformer sees the device's order (the CPU
    here, as a GPU that prefers cuDNN), though the process's order was left FlashAttention first, and the
    latents are the same bits: on the CPU the order picks no other kernel."""
    monkeypatch.setattr(devices, "prefers_cudnn_attention", lambda _device: True)
    seen = []
    attention = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(order())
        return attention(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    settings = sampler.SamplerSettings(tiny, **reference.settings, **FP32)
    with sdpa_kernel(FLASH_FIRST, set_priority=True):
        latents = sampler.sample(settings, reference.embeds)
    assert seen and all(each == CUDNN_FIRST for each in seen)
    assert torch.equal(latents, reference.latents)
