"""Low-VRAM mode (core/streaming.py): T5 layers and transformer blocks live in CPU memory and each is on
the compute device only while it runs. On the CPU the copies are no-ops, so these tests check what the
mode changes there: the results (identical, quantized or not), which blocks are loaded when, that the
token embeddings run on the CPU, and that the model is freed like any other. The GPU tier measures the
memory (tests/test_gpu.py) and the benchmark the time."""

from __future__ import annotations

import gc

import pytest
import torch
from tolerances import assert_close

from pixart_lowvram.core import estimates, sampler, sampler_settings, streaming, text_encoder
from pixart_lowvram.core.estimates import Workload

SETTINGS = {"width": 64, "height": 64, "steps": 2, "cfg": 4.5, "seed": 3}


@pytest.fixture
def block_log(monkeypatch):
    """Per block forward: (model class, block index, indices of the blocks loaded at that moment)."""
    log: list[tuple[str, int, list[int]]] = []
    original = streaming.BlockStreamer.__init__

    def init(self, blocks, device, prefetch, *rest):
        original(self, blocks, device, prefetch, *rest)

        for index, block in enumerate(blocks):

            def spy(_module, _args, _index=index, _streamer=self):
                loaded = [i for i, b in enumerate(_streamer.blocks) if b.loaded]
                log.append((type(_module).__name__, _index, loaded))

            # Runs after the streamer's own pre-hook (hooks run in registration order).
            block.register_forward_pre_hook(spy)

    monkeypatch.setattr(streaming.BlockStreamer, "__init__", init)
    return log


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_streamed_t5_gives_the_same_embeddings(tiny, reference, quantization, block_log):
    options = {"device": "cpu", "precision": torch.float32, "quantization": quantization}
    plain = text_encoder.encode(
        text_encoder.EncoderSettings(tiny, **options), reference.prompt, reference.negative
    )
    streamed = text_encoder.encode(
        text_encoder.EncoderSettings(tiny, low_vram=True, **options), reference.prompt, reference.negative
    )
    # Streamed and resident blocks: two placements of one network (on a GPU the blocks run on copies),
    # bounded as such (tests/tolerances.py); bit for bit on this CPU, where the copies are no-ops.
    assert_close(streamed.prompt_embeds, plain.prompt_embeds, network=True)
    assert_close(streamed.negative_embeds, plain.negative_embeds, network=True)
    layers = tiny.config("text_encoder")["num_layers"]
    # prompt and negative: two passes, each block alone on the device while it runs
    assert [(index, loaded) for _, index, loaded in block_log] == [(i, [i]) for i in range(layers)] * 2


@pytest.mark.parametrize("quantization", ["none", "qint8"])
def test_streamed_transformer_gives_the_same_latents(tiny, reference, quantization, block_log, monkeypatch):
    monkeypatch.setattr(estimates, "LOW_VRAM_BUDGET", 0)  # every run streams, even the int8 one that fits
    options = {"device": "cpu", "precision": torch.float32, "quantization": quantization}
    plain = sampler.sample(sampler_settings.SamplerSettings(tiny, **SETTINGS, **options), reference.embeds)
    streamed = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, low_vram=True, **options), reference.embeds
    )
    assert_close(streamed, plain, network=True)  # streamed against resident, as for T5 above
    blocks = tiny.config("transformer")["num_layers"]
    assert [(index, loaded) for _, index, loaded in block_log] == [(i, [i]) for i in range(blocks)] * 2


def test_a_transformer_that_fits_the_budget_is_not_streamed(tiny, reference, block_log):
    """low_vram holds the stage to the budget: the int8 transformer and its run fit whole (0.87 GiB at
    1024²), so it is not streamed; fp16, 2048² or a batch of two do not fit, and stream."""
    options = {"device": "cpu", "precision": torch.float32, "quantization": "qint8"}
    plain = sampler.sample(sampler_settings.SamplerSettings(tiny, **SETTINGS, **options), reference.embeds)
    low = sampler_settings.SamplerSettings(tiny, **SETTINGS, low_vram=True, **options)
    # Exact: not streamed, low_vram leaves the run as it is (the same model placement and kernels).
    torch.testing.assert_close(sampler.sample(low, reference.embeds), plain, rtol=0, atol=0)
    assert block_log == []  # no streamer was made
    megapixel = 1024 * 1024
    half = {"device": "cpu", "precision": torch.float16}
    assert not sampler_settings.SamplerSettings(tiny, **half, low_vram=True).streamed(Workload(1, megapixel))
    assert sampler_settings.SamplerSettings(tiny, **half, low_vram=True).streamed(Workload(1, 4 * megapixel))
    assert sampler_settings.SamplerSettings(tiny, **half, low_vram=True).streamed(Workload(2, megapixel))
    assert sampler_settings.SamplerSettings(tiny, **half, low_vram=True, quantization="none").streamed(
        Workload(1, megapixel)
    )
    assert not sampler_settings.SamplerSettings(tiny, **half).streamed(
        Workload(1, 4 * megapixel)
    )  # only with low_vram
    resident, streamed = (low.cache_key(Workload(1, pixels)) for pixels in (megapixel, 4 * megapixel))
    assert resident != streamed  # a kept model is found only for the placement it was made for


def test_t5_token_embeddings_run_on_the_cpu(tiny, reference, monkeypatch):
    """The embedding lookup gets CPU token ids even though the encoder is called with the device's."""
    seen = []
    original = torch.nn.Embedding.forward

    vocabulary = tiny.config("text_encoder")["vocab_size"]

    def forward(self, ids):
        if self.num_embeddings == vocabulary:  # (not T5's relative position buckets)
            seen.append((ids.device.type, self.weight.device.type))
        return original(self, ids)

    monkeypatch.setattr(torch.nn.Embedding, "forward", forward)
    settings = text_encoder.EncoderSettings(
        tiny, device="cpu", precision=torch.float32, quantization="none", low_vram=True
    )
    text_encoder.encode(settings, "a", "")
    assert seen == [("cpu", "cpu")] * 2


def test_streamed_models_are_freed_after_their_stage(tiny, reference, load_spy):
    options = {"device": "cpu", "precision": torch.float32, "low_vram": True}
    text_encoder.encode(text_encoder.EncoderSettings(tiny, **options, quantization="nf4"), reference.prompt)
    sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, **options, quantization="qint8"), reference.embeds
    )
    gc.collect()
    assert load_spy.alive("text_encoder") == [False]
    assert load_spy.alive("transformer") == [False]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_low_vram_must_be_a_bool(tiny, reference, value):
    with pytest.raises(TypeError, match="low_vram must be true or false"):
        text_encoder.encode(text_encoder.EncoderSettings(tiny, device="cpu", low_vram=value), "a")
    with pytest.raises(TypeError, match="low_vram must be true or false"):
        sampler.sample(
            sampler_settings.SamplerSettings(tiny, **SETTINGS, device="cpu", low_vram=value), reference.embeds
        )


def test_cli_low_vram_streams_both_models_and_tiles_the_decode(tiny_folder, tmp_path, monkeypatch):
    from pixart_lowvram.cli import main as cli
    from pixart_lowvram.core import vae

    calls = {}

    def spy(module, name):
        original = getattr(module, name)

        def wrapper(settings, *args, **kwargs):
            # The stage's settings object is its first argument: low_vram (encoder, sampler) or tiling (VAE).
            calls[name] = getattr(settings, "low_vram", getattr(settings, "tiling", None))
            return original(settings, *args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    spy(text_encoder, "encode")
    spy(sampler, "sample")
    spy(vae, "decode")
    argv = [
        "generate",
        "--model",
        str(tiny_folder),
        "--steps",
        "1",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    ]
    assert cli.main([*argv, "--low-vram", "--no-quant-cache"]) == 0
    assert calls == {"encode": True, "sample": True, "decode": "on"}


def test_a_streamed_models_resident_parts_move_without_its_blocks():
    """How a host offloads a streamed model and brings it back (ComfyUI's offload of a kept low-VRAM model):
    the parts outside the blocks move, the blocks stay in CPU memory. The meta device stands in for the GPU."""
    from pixart_lowvram.core import streaming

    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.nn.LayerNorm(8)
    )
    blocks = [model[1]]
    streamer = streaming.stream_blocks(model, blocks, "cpu", prefetch=False)
    assert streaming.streamer_of(model) is streamer and streaming.streamer_of(torch.nn.Linear(2, 2)) is None
    streamer.move_resident("meta")
    assert {p.device.type for p in model[0].parameters()} == {"meta"}
    assert {p.device.type for p in model[2].parameters()} == {"meta"}
    assert {p.device.type for p in model[1].parameters()} == {"cpu"}
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
