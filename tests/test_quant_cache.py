"""The pre-quantized weight cache: written once, read back bit-exact, keyed by weights and settings,
rebuilt when unreadable, safetensors and JSON only, cleared by the documented command. For T5
(bitsandbytes, transformers' own format) and the transformer (optimum-quanto's int8 and float8 values and
scales)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pixart_lowvram.cli import random_model
from pixart_lowvram.core import quant_cache, sampler, sampler_settings, text_encoder
from pixart_lowvram.core.models import resolve_model
from pixart_lowvram.core.pool import cache
from pixart_lowvram.core.quant import QUANTO


@pytest.fixture
def own_model(tiny_folder, tmp_path):
    """A copy of the tiny model whose files a test may touch."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    return resolve_model(str(folder))


def encode(source, cache_dir, scheme="nf4"):
    settings = text_encoder.EncoderSettings(source, quantization=scheme, quant_cache=cache_dir)
    cache.forget_results()  # T5 loads (through the quantized cache), not the remembered embeddings
    return text_encoder.encode(settings, "a red cat").prompt_embeds


def test_second_load_reads_the_entry_bit_exact(tiny, tmp_path, monkeypatch):
    first = encode(tiny, tmp_path)
    (entry,) = quant_cache.entries(tmp_path)
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "model.safetensors", "source.json"]

    def no_requantizing(*args, **kwargs):
        raise AssertionError("quantized again although the entry exists")

    monkeypatch.setattr(text_encoder.Scheme, "load_kwargs", no_requantizing)
    assert torch.equal(encode(tiny, tmp_path), first)


def test_cached_and_uncached_give_the_same_embeddings(tiny, tmp_path):
    for scheme in ("nf4", "nf4-recipe", "int8"):
        encode(tiny, tmp_path, scheme)  # writes
        assert torch.equal(encode(tiny, tmp_path, scheme), encode(tiny, None, scheme)), scheme
    assert len(quant_cache.entries(tmp_path)) == 3  # one per scheme


def test_changed_weights_make_a_new_entry(own_model, tmp_path):
    encode(own_model, tmp_path)
    weights = next((own_model.path / "text_encoder").glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    encode(own_model, tmp_path)
    assert len(quant_cache.entries(tmp_path)) == 2


def test_truncated_entry_is_rebuilt(tiny, tmp_path, caplog):
    first = encode(tiny, tmp_path)
    (entry,) = quant_cache.entries(tmp_path)
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    assert torch.equal(encode(tiny, tmp_path), first)
    assert "unreadable" in caplog.text
    assert quant_cache.entries(tmp_path) == [entry]
    assert weights.stat().st_size == size


def test_no_partial_entries_are_left(tiny, tmp_path):
    encode(tiny, tmp_path)
    assert not list(tmp_path.glob("*.partial"))


def test_an_interrupted_write_leaves_no_partial_entry(tmp_path):
    """Ctrl-C while an entry is saved: the interrupt goes on, and the half-written copy is removed."""

    def save(_model, folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quant_cache.load_or_build(tmp_path / "text_encoder-0", load=None, build=object, save=save)
    assert list(tmp_path.iterdir()) == []


def test_unquantized_loads_do_not_touch_the_cache(tiny, tmp_path):
    encode(tiny, tmp_path, "none")
    assert quant_cache.entries(tmp_path) == []


def test_cache_command_lists_and_clears(tiny, tmp_path):
    encode(tiny, tmp_path)
    cmd = [sys.executable, "-m", "pixart_lowvram", "cache", "--dir", str(tmp_path)]
    listing = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert str(tmp_path) in listing and "1 entries" in listing
    cleared = subprocess.run([*cmd, "--clear"], capture_output=True, text=True, check=True).stdout
    assert "cleared" in cleared
    assert quant_cache.entries(tmp_path) == []


def test_default_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(quant_cache.ENV, str(tmp_path / "here"))
    assert quant_cache.default_dir() == tmp_path / "here"


# ---- the transformer (optimum-quanto) ----------------------------------------------------------------

SAMPLING = {"width": 64, "height": 64, "steps": 2, "seed": 3}


def sample(source, cache_dir, scheme="qint8", precision="bf16", **settings):
    """Latents from the tiny transformer quantized with ``scheme``; bf16 on the CPU is where quanto's int8
    kernel (``_weight_int8pack_mm``) runs, the one that crashed on weights read in place from a file."""
    embeds = text_encoder.encode(text_encoder.EncoderSettings(source, quantization="none"), "a red cat")
    chosen = sampler_settings.SamplerSettings(
        source, **SAMPLING, quantization=scheme, precision=precision, quant_cache=cache_dir, **settings
    )
    return sampler.sample(chosen, embeds)


def test_transformer_second_load_reads_the_entry_bit_exact(tiny, tmp_path, monkeypatch):
    first = sample(tiny, tmp_path)
    (entry,) = quant_cache.entries(tmp_path)
    assert entry.name.startswith("transformer-")
    assert sorted(p.name for p in entry.iterdir()) == ["quanto.safetensors", "source.json"]

    def no_requantizing(*args, **kwargs):
        raise AssertionError("quantized again although the entry exists")

    monkeypatch.setattr(QUANTO, "after_load", no_requantizing)
    assert torch.equal(sample(tiny, tmp_path), first)


def test_a_warm_cache_samples_without_importing_quanto(tiny, tmp_path):
    """Read back from the cache, the transformer is built as the plain layers it runs: a fresh process never
    imports optimum-quanto (nor the torch._dynamo machinery its import brings) and gives the same latents."""
    written = sample(tiny, tmp_path)
    out = tmp_path / "latents.pt"
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_quant_cache import sample
from pixart_lowvram.core.models import resolve_model
latents = sample(resolve_model({str(tiny.path)!r}), {str(tmp_path)!r})
assert "optimum.quanto" not in sys.modules, "quanto was imported"
torch.save(latents, {str(out)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert torch.equal(torch.load(out), written)


@pytest.mark.parametrize("scheme", ["qint8", "qfloat8"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_transformer_cached_and_uncached_give_the_same_latents(tiny, tmp_path, scheme, precision):
    written = sample(tiny, tmp_path, scheme, precision)
    read = sample(tiny, tmp_path, scheme, precision)
    assert torch.equal(read, written) and torch.equal(read, sample(tiny, None, scheme, precision))
    (entry,) = quant_cache.entries(tmp_path)
    assert quant_cache.describe(entry).startswith(f"transformer from {tiny.path / 'transformer'}, {scheme}")


def test_transformer_entry_serves_low_vram_mode(tiny, tmp_path):
    """One entry for the transformer whether its blocks are streamed or not: the quantized weights are the
    same (on the CPU both run whole; streaming is tried on the GPU)."""
    whole = sample(tiny, tmp_path)
    assert torch.equal(sample(tiny, tmp_path, low_vram=True), whole)
    assert len(quant_cache.entries(tmp_path)) == 1


def test_transformer_single_file_has_its_own_entry(tiny, tmp_path):
    single = random_model.save_single_file_transformer(tiny.path, tmp_path / "transformer.safetensors")
    cache_dir = tmp_path / "cache"
    written = sample(tiny, cache_dir, transformer_file=single)
    assert torch.equal(sample(tiny, cache_dir, transformer_file=single), written)
    (entry,) = quant_cache.entries(cache_dir)
    assert quant_cache.source_of(entry)["source"] == str(single.absolute())


def test_truncated_transformer_entry_is_rebuilt(tiny, tmp_path, caplog):
    first = sample(tiny, tmp_path)
    (entry,) = quant_cache.entries(tmp_path)
    weights = entry / "quanto.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    assert torch.equal(sample(tiny, tmp_path), first)
    assert "unreadable" in caplog.text and weights.stat().st_size == size


def test_unquantized_transformer_does_not_touch_the_cache(tiny, tmp_path):
    sample(tiny, tmp_path, "none")
    assert quant_cache.entries(tmp_path) == []


def test_the_cache_folder_may_be_given_as_text(tiny, tmp_path):
    settings = sampler_settings.SamplerSettings(tiny, quant_cache=str(tmp_path), device="cpu")
    assert settings.quant_cache == tmp_path
    assert text_encoder.EncoderSettings(tiny, quant_cache=str(tmp_path)).quant_cache == tmp_path


def test_t5_loads_and_saves_without_transformers_bars(tiny, tmp_path, capfd):
    """transformers' "Loading weights" and "Writing model shards" bars are off while T5 is quantized, saved
    to the cache and read back (in ComfyUI's log they were lines of noise each prompt), and its switches (and
    huggingface_hub's) are as they were afterwards. The same load outside the stage shows its bar: this
    capture sees one."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers import T5EncoderModel
    from transformers.utils import logging as transformers_logging

    folder = tiny.path / "text_encoder"
    transformers_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        T5EncoderModel.from_pretrained(folder)
        assert "Loading weights" in capfd.readouterr().err, "a bar this capture sees"
        encode(tiny, tmp_path)  # quantized and written to the cache
        encode(tiny, tmp_path)  # read back from it
        assert len(quant_cache.entries(tmp_path)) == 1
        err = capfd.readouterr().err
        assert "Loading weights" not in err and "Writing model shards" not in err, err[-2000:]
        assert transformers_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
        disable_progress_bars()  # huggingface_hub's off alone: it stays off, transformers' stays on
        with text_encoder.quiet_progress_bars():
            assert not transformers_logging.is_progress_bar_enabled()
        assert transformers_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
        transformers_logging.disable_progress_bar()  # both off: both stay off
        with text_encoder.quiet_progress_bars():
            pass
        assert not transformers_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    finally:
        transformers_logging.enable_progress_bar()
