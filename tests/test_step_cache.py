"""The sampler's step_cache (lossy, off by default): diffusers' First Block Cache on the transformer for one
run. Below every step's change it runs every block and gives the uncached run's bits (the same kernels on the
same data; the hooks only compare); above it, steps skip the blocks after the first and the latents move
away from the uncached ones. Its hooks come off after the run, failed or not, so a kept transformer runs
uncached again."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from pixart_lowvram.core import sampler, sampler_settings, transformer_run
from pixart_lowvram.core.pool import cache

FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}
STEPS = 10


def run(tiny, reference, step_cache: float, on_progress=None, **options) -> torch.Tensor:
    settings = sampler_settings.SamplerSettings(
        tiny, width=64, height=64, steps=STEPS, seed=3, step_cache=step_cache, **{**FP32, **options}
    )
    return sampler.sample(settings, reference.embeds, on_progress=on_progress)


def full_steps(caplog) -> int:
    (found,) = re.findall(r"ran every block on (\d+) of (\d+) steps", caplog.text)
    assert int(found[1]) == STEPS
    return int(found[0])


def no_cache_hooks(transformer) -> bool:
    registries = [getattr(m, "_diffusers_hook", None) for m in transformer.modules()]
    return all(registry is None or not registry.hooks for registry in registries)


@pytest.fixture(scope="module")
def uncached(tiny, reference) -> torch.Tensor:
    return run(tiny, reference, 0.0)


def test_below_every_change_it_is_the_uncached_run(tiny, reference, uncached, caplog):
    with caplog.at_level(logging.INFO, logger="pixart_lowvram.core.transformer_run"):
        cached = run(tiny, reference, 1e-9)
    assert full_steps(caplog) == STEPS
    assert torch.equal(cached, uncached)


def test_above_it_steps_skip_blocks_and_the_latents_move(tiny, reference, uncached, caplog):
    with caplog.at_level(logging.INFO, logger="pixart_lowvram.core.transformer_run"):
        cached = run(tiny, reference, 0.5)
    assert 1 <= full_steps(caplog) < STEPS  # the first step always runs whole
    assert torch.isfinite(cached).all() and not torch.equal(cached, uncached)
    again = run(tiny, reference, 0.5)
    assert torch.equal(cached, again), "the same seed and threshold give the same image"


def test_a_kept_transformer_runs_uncached_after_it(tiny, reference, uncached):
    run(tiny, reference, 0.5, keep_loaded=True)
    (key,) = cache.keys()
    assert torch.equal(run(tiny, reference, 0.0, keep_loaded=True), uncached)
    assert cache.keys() == [key], "the same kept model"


def test_a_failed_run_takes_its_hooks_off(tiny, reference, uncached, monkeypatch):
    seen = []
    original = transformer_run._step_cache

    def spy(transformer, threshold, steps):
        seen.append(transformer)
        return original(transformer, threshold, steps)

    monkeypatch.setattr(transformer_run, "_step_cache", spy)

    class Cancelled(Exception):
        pass

    def cancel(step, _total, _latents):
        assert not no_cache_hooks(seen[0]), "the hooks are on during the run"
        if step == 3:
            raise Cancelled

    with pytest.raises(Cancelled):
        run(tiny, reference, 0.5, on_progress=cancel, keep_loaded=True)
    assert no_cache_hooks(seen[0])
    assert torch.equal(run(tiny, reference, 0.0, keep_loaded=True), uncached)


def test_out_of_range_is_refused_with_the_range(tiny):
    with pytest.raises(ValueError, match=r"step_cache.*0.*1"):
        sampler_settings.SamplerSettings(tiny, step_cache=1.5, **FP32)
