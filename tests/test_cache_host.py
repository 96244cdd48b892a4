"""The keep-loaded cache's host hooks (what ComfyUI's memory manager is told) and the stages' room
estimates; the SDXL VAE from a single file (both key layouts, offline, safetensors only)."""

from __future__ import annotations

import socket

import pytest
import torch
from safetensors.torch import load_file, save_file
from vae_layout import to_original_layout

from pixart_lowvram.core import estimates, vae
from pixart_lowvram.core.pool import ModelCache
from pixart_lowvram.core.quant import TEXT_ENCODER_SCHEMES, TRANSFORMER_SCHEMES

GPU = torch.device("cuda", 0)


class RecordingHost:
    """A host that records what the cache asks of it; its handle is a box around the model."""

    def __init__(self):
        self.calls = []

    def make_room(self, needs, device):
        self.calls.append(("make_room", needs, device))

    def hold(self, key, model, device):
        self.calls.append(("hold", key, device))
        return [model]

    def ready(self, handle, work):
        self.calls.append(("ready", work))
        return handle[0]

    def offload(self, handle):
        self.calls.append(("offload",))


@pytest.fixture
def hosted():
    cache = ModelCache()
    cache.host = RecordingHost()
    return cache


def test_host_makes_room_before_a_load_holds_the_model_and_readies_it_for_each_run(hosted):
    with hosted.use("k", torch.nn.Identity, keep=True, device=GPU, weights=100, work=10) as model:
        assert hosted.host.calls == [("make_room", 110, GPU), ("hold", "k", GPU), ("ready", 10)]
        assert isinstance(model, torch.nn.Identity)  # the model, not the host's handle
    hosted.host.calls.clear()
    with hosted.use("k", torch.nn.Identity, keep=False, device=GPU, weights=100, work=10) as again:
        assert again is model
    # Reused: no room for its weights and no new handle; the host readies it (room for its run only), and,
    # not kept, offloads it into host memory, where its handle waits in the pool.
    assert hosted.host.calls == [("ready", 10), ("offload",)]
    assert len(hosted) == 0 and hosted.pooled() == ["k"]
    hosted.host.calls.clear()
    with hosted.use("k", lambda: pytest.fail("loaded again"), keep=False, device=GPU, work=10) as third:
        assert third is model
    assert hosted.host.calls == [("ready", 10), ("offload",)]


def test_with_a_host_the_pool_keeps_its_budget_and_clear_empties_it(hosted):
    hosted.host_budget = 3 * 4  # bytes: three one-float models
    for key in ("a", "b", "c", "d"):
        with hosted.use(key, lambda: torch.nn.Linear(1, 1, bias=False), keep=False, device=GPU):
            pass
    assert hosted.pooled() == ["b", "c", "d"] and hosted.pool_bytes() == 12  # the least recently used out
    hosted.host_budget = 0
    with hosted.use("e", torch.nn.Identity, keep=False, device=GPU):
        pass
    assert hosted.pooled() == ["b", "c", "d"]  # a budget of 0: not pooled, and not offloaded
    assert hosted.host.calls.count(("offload",)) == 4
    hosted.clear()
    assert hosted.pooled() == [] and hosted.pool_bytes() == 0


def test_a_failed_stage_is_not_kept(hosted):
    with pytest.raises(RuntimeError), hosted.use("k", torch.nn.Identity, keep=True, device=GPU):
        raise RuntimeError("stage failed")
    assert len(hosted) == 0


def test_clear_drops_every_kept_model(hosted):
    for key in ("a", "b", "c"):
        with hosted.use(key, torch.nn.Identity, keep=True, device=GPU):
            pass
    assert sorted(hosted.keys()) == ["a", "b", "c"]
    assert hosted.clear() == 3 and len(hosted) == 0


def test_without_a_host_nothing_is_asked():
    cache = ModelCache()
    with cache.use("k", torch.nn.Identity, keep=True, device=GPU, weights=1, work=1) as model:
        assert isinstance(model, torch.nn.Identity)
    assert cache.keys() == ["k"]


def images_pixels(latents: torch.Tensor) -> tuple[int, int]:
    """estimates.transformer's (images, pixels) for a batch of latents."""
    return latents.shape[0], (latents.shape[-1] * 8) * (latents.shape[-2] * 8)


def test_estimates_follow_the_measured_peaks():
    gib = estimates.GIB
    t5, dit = TEXT_ENCODER_SCHEMES, TRANSFORMER_SCHEMES
    assert sum(estimates.text_encoder(t5["nf4"], torch.bfloat16)) == pytest.approx(2.7 * gib, rel=0.01)
    assert sum(estimates.text_encoder(t5["none"], torch.float32)) == 2 * sum(
        estimates.text_encoder(t5["none"], torch.bfloat16)
    )
    latents = torch.empty(1, 4, 128, 128, device="meta")
    assert sum(estimates.transformer(dit["qint8"], torch.float16, *images_pixels(latents))) == pytest.approx(
        0.87 * gib, rel=0.1
    )
    assert sum(estimates.transformer(dit["none"], torch.float16, *images_pixels(latents))) == pytest.approx(
        1.41 * gib, rel=0.1
    )
    # The run's part scales with pixels × batch.
    four = torch.empty(2, 4, 256, 128, device="meta")
    assert (
        estimates.transformer(dit["qint8"], torch.float16, *images_pixels(four))[1]
        == 4 * estimates.transformer(dit["qint8"], torch.float16, *images_pixels(latents))[1]
    )
    # The decode (measured on an H200 with its convolutions in strips: 1.88 GiB whole, 0.85 GiB in tiles).
    assert sum(estimates.vae_needs(latents, torch.bfloat16, None)) == pytest.approx(1.88 * gib, rel=0.1)
    assert sum(estimates.vae_needs(latents, torch.bfloat16, vae.TILE_SIZE)) == pytest.approx(
        0.85 * gib, rel=0.1
    )
    # Low-VRAM mode (measured: T5 nf4 0.40 GiB, bf16 0.85 GiB, transformer qint8 0.33 GiB).
    assert sum(estimates.text_encoder(t5["nf4"], torch.bfloat16, low_vram=True)) == pytest.approx(
        0.40 * gib, rel=0.15
    )
    assert sum(estimates.text_encoder(t5["none"], torch.bfloat16, low_vram=True)) == pytest.approx(
        0.85 * gib, rel=0.15
    )
    streamed = sum(estimates.transformer(dit["qint8"], torch.float16, *images_pixels(latents), low_vram=True))
    assert streamed == pytest.approx(0.33 * gib, rel=0.15)


@pytest.fixture(scope="module")
def vae_files(tmp_path_factory, tiny_folder):
    folder = tmp_path_factory.mktemp("vae_files")
    weights = load_file(tiny_folder / "vae" / "diffusion_pytorch_model.safetensors")
    save_file(weights, folder / "diffusers_layout.safetensors")
    save_file(to_original_layout(weights), folder / "original_layout.safetensors")
    return folder


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the VAE file's config must not be fetched")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("layout", ["original_layout", "diffusers_layout"])
def test_decode_with_a_single_file_equals_the_model_folder(tiny, reference, vae_files, no_network, layout):
    settings = vae.DecoderSettings(
        tiny, device="cpu", precision=torch.float32, vae_file=vae_files / f"{layout}.safetensors"
    )
    decoded = vae.decode(settings, reference.latents)
    # Exact: the folder's weights bit for bit in the same decoder, so the same kernels on the same data.
    assert torch.equal(decoded, reference.images)


def test_sdxl_vae_file_fixture_holds_the_tiny_models_weights(sdxl_vae_file, vae_files):
    fixture, converted = load_file(sdxl_vae_file), load_file(vae_files / "original_layout.safetensors")
    assert fixture.keys() == converted.keys()
    assert all(torch.equal(fixture[k], converted[k]) for k in fixture)


def test_a_hub_model_uses_the_bundled_sdxl_config(tiny_folder, vae_files, no_network):
    from pixart_lowvram.core.models import ModelSource

    hub = ModelSource(name="owner/repo", hub_id="owner/repo")
    settings = vae.DecoderSettings(
        hub, device="cpu", precision=torch.float32, vae_file=vae_files / "original_layout.safetensors"
    )
    model = vae._load(settings)
    assert model.config.scaling_factor == 0.13025 and model.config.sample_size == 1024
    expected = load_file(tiny_folder / "vae" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("sdxl_vae.pt", b"pickle", "only .safetensors files are read"),
        ("sdxl_vae.ckpt", b"pickle", "only .safetensors files are read"),
        ("missing.safetensors", None, "does not exist"),
        ("truncated.safetensors", b"\x10\x00", "not a readable safetensors file"),
    ],
)
def test_bad_vae_files_are_refused_before_loading(tiny, tmp_path, load_spy, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
        vae.decode(vae.DecoderSettings(tiny, device="cpu", vae_file=path), torch.zeros(1, 4, 8, 8))
    assert "models/vae" in str(error.value)
    assert load_spy.total() == 0


def test_a_vae_of_another_family_is_refused(tiny, tmp_path, load_spy):
    path = tmp_path / "flux_ae.safetensors"
    save_file({"decoder.conv_in.weight": torch.zeros(512, 16, 3, 3)}, path)
    with pytest.raises(ValueError, match=r"not an SDXL VAE .*\[512, 16, 3, 3\]"):
        vae.decode(vae.DecoderSettings(tiny, device="cpu", vae_file=path), torch.zeros(1, 4, 8, 8))
    assert load_spy.total() == 0
