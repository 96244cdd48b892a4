"""Each stage really unloads its model: weak references to what the load functions returned are dead
when the stage returns, also when it fails; keep_loaded keeps exactly one model until the cache is
cleared."""

from __future__ import annotations

import gc

import pytest
import torch

from pixart_lowvram.core import measure, sampler, sampler_settings, text_encoder, timeline, vae
from pixart_lowvram.core.pool import cache, free_all

STAGES = ("text_encoder", "transformer", "vae")


class Stop(RuntimeError):
    """Raised from inside a stage by the tests."""


@pytest.fixture
def run_stage(tiny, reference):
    """Run one stage on the tiny model (fp32, unquantized unless overridden)."""

    def run(stage: str, report=None, on_progress=None, **overrides):
        options = {"device": "cpu", "precision": torch.float32, **overrides}
        hooks = {"report": report, "on_progress": on_progress}
        if stage == "vae":
            latents = options.pop("latents", reference.latents)
            return vae.decode(vae.DecoderSettings(tiny, **options), latents, **hooks)
        options.setdefault("quantization", "none")
        if stage == "text_encoder":
            settings = text_encoder.EncoderSettings(tiny, **options)
            return text_encoder.encode(settings, reference.prompt, reference.negative, **hooks)
        settings = sampler_settings.SamplerSettings(tiny, width=64, height=64, steps=2, **options)
        return sampler.sample(settings, reference.embeds, **hooks)

    return run


@pytest.mark.parametrize(
    ("stage", "quantization"),
    [
        ("text_encoder", "none"),
        ("text_encoder", "nf4"),
        ("transformer", "none"),
        ("transformer", "qint8"),
        ("vae", None),
    ],
)
def test_stage_frees_its_model_before_returning(run_stage, load_spy, stage, quantization):
    options = {} if quantization is None else {"quantization": quantization}
    run_stage(stage, **options)
    assert load_spy.count(stage) == 1
    # No gc.collect() here: the stage itself must have collected before returning.
    assert load_spy.last(stage)() is None
    assert len(cache) == 0


def test_sample_exception_frees_the_transformer(run_stage, load_spy):
    def stop_at_first_step(step: int, total: int, latents: torch.Tensor) -> None:
        raise Stop(f"stopped at step {step} of {total}")

    report = measure.MemoryReport()
    with pytest.raises(Stop, match="step 1 of 2"):
        run_stage("transformer", on_progress=stop_at_first_step, report=report)
    gc.collect()
    assert load_spy.count("transformer") == 1
    assert load_spy.last("transformer")() is None
    [record] = report.stages
    assert record.stage == "sample"
    assert record.error == "Stop"
    assert "failed: Stop" in report.markdown()


def test_propagating_exception_does_not_hold_the_transformer(run_stage, load_spy):
    def stop(step: int, total: int, latents: torch.Tensor) -> None:
        raise Stop

    try:
        run_stage("transformer", on_progress=stop)
    except Stop:
        # The exception (and its traceback) is still alive here, as in a caller that reports it.
        assert load_spy.alive("transformer") == [False]


def test_encode_exception_frees_t5(run_stage, load_spy, monkeypatch):
    def fail(**_fields):
        raise Stop("after the encoder ran")

    # Fails after T5 has run, inside the stage: building the result.
    monkeypatch.setattr(text_encoder, "PixArtEmbeds", fail)
    report = measure.MemoryReport()
    with pytest.raises(Stop):
        run_stage("text_encoder", report=report)
    assert load_spy.alive("text_encoder") == [False]
    assert [(r.stage, r.error) for r in report.stages] == [("t5_encode", "Stop")]


def test_decode_exception_frees_vae(run_stage, load_spy):
    # A meta tensor passes the shape check but cannot be copied to the device, after the VAE loaded.
    report = measure.MemoryReport()
    with pytest.raises(NotImplementedError):
        run_stage("vae", latents=torch.empty(1, 4, 8, 8, device="meta"), report=report)
    assert load_spy.alive("vae") == [False]
    assert [(r.stage, r.error) for r in report.stages] == [("vae_decode", "NotImplementedError")]


@pytest.mark.parametrize("stage", STAGES)
def test_keep_loaded_reuses_until_cleared(run_stage, load_spy, stage):
    first = run_stage(stage, keep_loaded=True)
    second = run_stage(stage, keep_loaded=True)
    assert load_spy.count(stage) == 1, "the second run reuses the kept model"
    assert load_spy.alive(stage) == [True]
    assert len(cache) == 1
    assert torch.equal(
        first.prompt_embeds if stage == "text_encoder" else first,
        second.prompt_embeds if stage == "text_encoder" else second,
    )

    assert cache.clear() == 1
    assert load_spy.last(stage)() is None, "clear() collects before returning"
    assert len(cache) == 0


@pytest.mark.parametrize("stage", STAGES)
def test_run_without_keep_releases_a_kept_model(run_stage, load_spy, stage):
    run_stage(stage, keep_loaded=True)
    run_stage(stage, keep_loaded=False)
    assert load_spy.count(stage) == 1
    assert load_spy.alive(stage) == [False]
    assert len(cache) == 0


def test_failed_stage_does_not_keep_its_model(run_stage, load_spy):
    def stop(step: int, total: int, latents: torch.Tensor) -> None:
        raise Stop

    with pytest.raises(Stop):
        run_stage("transformer", keep_loaded=True, on_progress=stop)
    assert len(cache) == 0
    assert load_spy.alive("transformer") == [False]


def test_kept_models_are_keyed_by_settings(run_stage, load_spy):
    run_stage("text_encoder", keep_loaded=True)
    run_stage("text_encoder", keep_loaded=True, precision=torch.bfloat16)
    run_stage("vae", keep_loaded=True)
    assert load_spy.count("text_encoder") == 2
    assert load_spy.alive("text_encoder") == [True, True]
    assert cache.clear() == 3
    assert load_spy.alive("text_encoder") == [False, False]
    assert load_spy.alive("vae") == [False]


def test_free_all_drops_kept_models_and_asks_the_host(run_stage, load_spy):
    run_stage("vae", keep_loaded=True)
    released = []
    result = free_all(release_others=lambda: released.append(True))
    assert result.models_dropped == 1
    assert released == [True]
    assert load_spy.last("vae")() is None
    assert "dropped 1 kept model(s)" in result.summary()
    assert len(cache) == 0


@pytest.mark.parametrize(
    "prefix",
    [
        "pixart_memory",
        "sigma-v1.5",
    ],
)
def test_memory_record_lists_the_stages(run_stage, tmp_path, prefix):
    report = measure.MemoryReport()
    run_stage("text_encoder", report=report)
    run_stage("vae", report=report)
    summary = timeline.write_record(report, tmp_path, prefix).summary
    timeline.write_record(report, tmp_path, prefix)
    assert "t5_encode" in summary and "vae_decode" in summary
    names = {p.name for p in tmp_path.iterdir()}
    for number in ("00001", "00002"):
        assert {f"{prefix}_{number}.md", f"{prefix}_{number}.json"} <= names
    if not torch.cuda.is_available():
        assert measure.NO_CUDA in summary
        assert not any(name.endswith(".pickle") for name in names)
