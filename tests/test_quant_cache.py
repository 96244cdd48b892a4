"""The pre-quantized weight cache: written once, read back bit-exact, keyed by weights and settings,
rebuilt when unreadable, safetensors and JSON only, cleared by the documented command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from pixart_lowvram.core import quant_cache, text_encoder
from pixart_lowvram.core.models import resolve_model


@pytest.fixture
def own_model(tiny_folder, tmp_path):
    """A copy of the tiny model whose files a test may touch."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    return resolve_model(str(folder))


def encode(source, cache_dir, scheme="nf4"):
    settings = text_encoder.EncoderSettings(source, quantization=scheme, quant_cache=cache_dir)
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
