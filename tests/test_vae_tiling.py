"""Tiled VAE decode: engages at the sizes asked for, stays close to the untiled decode, and is
chosen automatically only when memory is short; the untiled decode's memory savings (in-place SiLUs,
convolutions in strips) keep diffusers' numbers, to the rounding tests/tolerances.py allows other kernels."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from pixart_lowvram.core import estimates, vae


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    # 128 px: nine overlapping 64-px tiles; raw VAE space like a sampler's LATENT.
    return torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3)) * 4


def test_tiled_decode_is_close_to_untiled(tiny, latents):
    """Tiles are decoded separately and blended over a quarter of their size. With the tiny random VAE
    the mean abs difference measured 0.059 for 64-px tiles of a 128-px image (images 0..1): GroupNorm
    sees each tile's statistics. Bound: 0.08."""
    whole = vae.decode(vae.DecoderSettings(tiny, device="cpu", tiling="off"), latents)
    tiled = vae.decode(vae.DecoderSettings(tiny, device="cpu", tiling="on", tile_size=64), latents)
    assert tiled.shape == whole.shape == (1, 128, 128, 3)
    assert torch.isfinite(tiled).all()
    difference = (tiled - whole).abs().mean()
    assert 0 < difference <= 0.08, float(difference)  # > 0: tiling really engaged


def test_a_tile_as_big_as_the_image_changes_nothing(tiny, latents):
    whole = vae.decode(vae.DecoderSettings(tiny, device="cpu", tiling="off"), latents)
    tiled = vae.decode(vae.DecoderSettings(tiny, device="cpu", tiling="on", tile_size=128), latents)
    # Exact: diffusers tiles only latents larger than a tile, so this is the untiled decode itself.
    assert torch.equal(tiled, whole)


def test_auto_tiles_only_on_cuda_when_short(latents):
    cpu = torch.device("cpu")
    assert vae.use_tiles("on", latents, torch.float32, cpu)
    assert not vae.use_tiles("off", latents, torch.float32, cpu)
    assert not vae.use_tiles("auto", latents, torch.float32, cpu)  # host memory is not the GPU's problem


def test_untiled_estimate_matches_the_measured_1024_decode():
    # Measured on an H200: 1.72 GiB of activations for a bf16 decode at 1024² (1.88 GiB with the weights),
    # the convolutions in strips.
    estimate = estimates.vae_untiled_bytes(torch.empty(1, 4, 128, 128), torch.bfloat16)
    assert 1.72 * 2**30 <= estimate <= 2.0 * 2**30


@pytest.mark.parametrize(
    "bad", [("tiling", "sometimes"), ("tile_size", 32), ("tile_size", 100), ("tile_size", True)]
)
def test_bad_tiling_settings_are_refused_before_loading(tiny, latents, load_spy, bad):
    name, value = bad
    with pytest.raises(ValueError, match=name):
        vae.decode(vae.DecoderSettings(tiny, device="cpu", **{name: value}), latents)
    assert load_spy.count("vae") == 0


def test_the_decoders_silus_run_in_place_with_the_same_numbers(tiny, latents):
    """Each SiLU of the decoder overwrites the GroupNorm output it reads (one image-sized activation fewer
    at the widest point): the image is diffusers' own decode (bit for bit here; bounded as two computations
    of one network, tests/tolerances.py)."""
    from diffusers import AutoencoderKL

    settings = vae.DecoderSettings(tiny, device="cpu", tiling="off")
    model = vae._load(settings)
    silus = [m for m in model.decoder.modules() if isinstance(m, torch.nn.SiLU)]
    assert silus and all(m.inplace for m in silus)
    plain = AutoencoderKL.from_pretrained(tiny.folder(["vae"]), subfolder="vae", dtype=settings.dtype).eval()
    assert not any(m.inplace for m in plain.decoder.modules() if isinstance(m, torch.nn.SiLU))
    with torch.inference_mode():
        assert_close(model.decode(latents).sample, plain.decode(latents).sample, network=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kernel", "padding"), [(3, 1), (1, 0), (5, 2)])
def test_a_convolution_in_strips_gives_the_whole_ones_numbers(monkeypatch, dtype, kernel, padding):
    """Each output row sums the inputs the whole convolution's does; the backend may sum a strip in another
    order (another kernel for another height), so within one operation's rounding (tests/tolerances.py)."""
    conv = torch.nn.Conv2d(8, 12, kernel, padding=padding).to(dtype)
    assert vae.strips_fit(conv)
    x = torch.randn(2, 8, 23, 9, generator=torch.Generator().manual_seed(1)).to(dtype)
    whole = conv(x)
    conv.__class__ = vae.StripConv2d
    row = x[..., :1, :].numel() * x.element_size()
    for rows in (1, 2, 5, 22, 23):  # strips of 1 row to the whole height
        monkeypatch.setattr(vae, "STRIP_BYTES", rows * row)
        assert_close(conv(x), whole, msg=lambda text, rows=rows: f"strips of {rows} rows: {text}")


def test_only_height_keeping_convolutions_run_in_strips():
    assert not vae.strips_fit(torch.nn.Conv2d(4, 4, 3, stride=2, padding=1))
    assert not vae.strips_fit(torch.nn.Conv2d(4, 4, 3, padding=0))
    assert not vae.strips_fit(torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"))
    assert not vae.strips_fit(torch.nn.Conv2d(4, 4, 3, padding=1, dilation=2))
    assert not vae.strips_fit(torch.nn.Conv2d(4, 4, 3, padding=1, groups=2))


def test_the_decoder_in_strips_gives_diffusers_numbers(tiny, latents, monkeypatch):
    """Every convolution of the loaded decoder runs in strips (here of a few rows each, as the widest ones at
    1024² do): the image is diffusers' own decode, to the rounding of a network whose convolutions may each
    sum in another order (tests/tolerances.py: 2.1e-6 apart on an AVX-512 CI machine, not bit for bit)."""
    from diffusers import AutoencoderKL

    settings = vae.DecoderSettings(tiny, device="cpu", tiling="off")
    model = vae._load(settings)
    convs = [m for m in model.decoder.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(isinstance(m, vae.StripConv2d) for m in convs)
    plain = AutoencoderKL.from_pretrained(tiny.folder(["vae"]), subfolder="vae", dtype=settings.dtype).eval()
    monkeypatch.setattr(vae, "STRIP_BYTES", 16 * 2**10)  # 16 KiB: strips of 1 to 8 rows here
    with torch.inference_mode():
        assert_close(model.decode(latents).sample, plain.decode(latents).sample, network=True)
