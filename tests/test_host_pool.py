"""Nothing done twice per prompt. Models leave the device, not the machine: without a host (the command
line, the library) a stage that does not keep its model puts it into host memory, the next run with the
same settings takes it back instead of loading and quantizing again, and gives the same result bit for
bit; the pool keeps within its budget (least recently used out), never holds a failed stage's model, and
is emptied by Free VRAM. On the CPU the model's device is host memory already; the GPU tier checks the
moves (test_gpu.py). The tokenizer is read once per process."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import transformers

from pixart_lowvram.cli import main as cli
from pixart_lowvram.core import sampler, sampler_settings, text_encoder, vae
from pixart_lowvram.core.models import resolve_model
from pixart_lowvram.core.pool import (
    HOST_BUDGET_ENV,
    ModelCache,
    cache,
    default_host_budget,
    free_all,
)

STAGES = ("text_encoder", "transformer", "vae")
CPU = torch.device("cpu")
LINEAR_BYTES = 64 * 65 * 4  # torch.nn.Linear(64, 64), float32


def run(stage: str, tiny, reference, **overrides):
    """One stage on the tiny model, quantized as by default (T5 nf4, transformer qint8), on the CPU."""
    options = {"device": "cpu", **overrides}
    if stage == "vae":
        return vae.decode(vae.DecoderSettings(tiny, **options), reference.latents)
    if stage == "text_encoder":
        settings = text_encoder.EncoderSettings(tiny, **options)
        cache.forget_results()  # the model runs again, not the remembered embeddings (test_t5_embeddings.py)
        return text_encoder.encode(settings, reference.prompt, reference.negative).prompt_embeds
    settings = sampler_settings.SamplerSettings(tiny, width=64, height=64, steps=2, seed=5, **options)
    return sampler.sample(settings, reference.embeds)


@pytest.mark.parametrize("stage", STAGES)
def test_the_second_run_takes_the_model_from_host_memory(tiny, reference, load_spy, host_pool, stage, caplog):
    first = run(stage, tiny, reference)
    assert len(cache) == 0 and len(cache.pooled()) == 1, "not kept, but waiting in host memory"
    with caplog.at_level(logging.INFO, logger="pixart_lowvram.core.pool"):
        second = run(stage, tiny, reference)
    assert load_spy.count(stage) == 1, "loaded (and quantized) once"
    assert "from host memory" in caplog.text
    assert torch.equal(first, second)
    assert load_spy.alive(stage) == [True]
    (key,) = cache.pooled()
    assert key[0] == stage and 0 < cache.pool_bytes() <= host_pool


def test_every_stage_waits_in_host_memory_within_the_default_budget(tiny, reference, host_pool):
    for stage in STAGES:
        run(stage, tiny, reference)
    assert [key[0] for key in cache.pooled()] == list(STAGES)
    assert cache.pool_bytes() <= host_pool == 4 * 2**30


def test_different_settings_are_different_models(tiny, reference, load_spy, host_pool):
    run("transformer", tiny, reference)
    run("transformer", tiny, reference, quantization="none")
    run("transformer", tiny, reference)
    assert load_spy.count("transformer") == 2
    assert len(cache.pooled()) == 2


def test_free_vram_drops_the_models_in_host_memory(tiny, reference, load_spy, host_pool):
    run("vae", tiny, reference)
    run("transformer", tiny, reference, keep_loaded=True)
    result = free_all()
    assert (result.models_dropped, result.pooled_dropped) == (1, 1) and result.pooled_bytes > 0
    assert "dropped 1 kept model(s) and 1 from host memory" in result.summary()
    assert cache.pooled() == [] and cache.pool_bytes() == 0
    assert load_spy.alive("vae") == [False] and load_spy.alive("transformer") == [False]


def test_a_failed_stage_leaves_nothing_in_host_memory(tiny, reference, load_spy, host_pool):
    def stop(step: int, total: int, latents: torch.Tensor) -> None:
        raise KeyboardInterrupt

    settings = sampler_settings.SamplerSettings(tiny, width=64, height=64, steps=2, device="cpu")
    with pytest.raises(KeyboardInterrupt):
        sampler.sample(settings, reference.embeds, on_progress=stop)
    assert cache.pooled() == [] and load_spy.alive("transformer") == [False]


def test_keep_loaded_takes_the_model_out_of_host_memory(tiny, reference, load_spy, host_pool):
    run("vae", tiny, reference)
    run("vae", tiny, reference, keep_loaded=True)
    assert load_spy.count("vae") == 1
    assert cache.pooled() == [] and len(cache) == 1


def test_budget_zero_frees_every_model(tiny, reference, load_spy):
    cache.host_budget = 0  # as the fixture leaves it: $PIXART_LOWVRAM_HOST_POOL_GIB=0
    run("vae", tiny, reference)
    run("vae", tiny, reference)
    assert load_spy.count("vae") == 2 and load_spy.alive("vae") == [False, False]
    assert cache.pooled() == []


# ---- the pool's rules, on small modules ------------------------------------------------------------


def use(pool: ModelCache, key: str, built: list[str] | None = None) -> torch.nn.Module:
    def build() -> torch.nn.Module:
        if built is not None:
            built.append(key)
        return torch.nn.Linear(64, 64)

    with pool.use(key, build, keep=False, device=CPU) as model:
        return model


def test_least_recently_used_leaves_first():
    pool, built = ModelCache(host_budget=2 * LINEAR_BYTES), []
    a = use(pool, "a", built)
    use(pool, "b", built)
    assert use(pool, "a", built) is a  # a is now the most recent
    use(pool, "c", built)  # over budget: b leaves
    assert pool.pooled() == ["a", "c"] and pool.pool_bytes() == 2 * LINEAR_BYTES
    use(pool, "b", built)
    assert built == ["a", "b", "c", "b"]
    assert pool.pooled() == ["c", "b"]


def test_a_model_larger_than_the_budget_is_not_kept(caplog):
    pool = ModelCache(host_budget=LINEAR_BYTES - 1)
    with caplog.at_level(logging.INFO, logger="pixart_lowvram.core.pool"):
        use(pool, "a")
    assert pool.pooled() == [] and "larger than the host memory budget" in caplog.text


def test_clear_empties_the_pool():
    pool = ModelCache(host_budget=1 << 30)
    use(pool, "a"), use(pool, "b")
    assert pool.clear() == 0  # none kept
    assert pool.pooled() == [] and pool.pool_bytes() == 0


@pytest.mark.parametrize(("value", "expected"), [("", 4 * 2**30), ("0", 0), ("2.5", int(2.5 * 2**30))])
def test_the_budget_comes_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(HOST_BUDGET_ENV, value)
    assert default_host_budget() == expected


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_a_bad_budget_names_the_variable_and_the_fix(monkeypatch, value):
    monkeypatch.setenv(HOST_BUDGET_ENV, value)
    with pytest.raises(ValueError, match=rf"{HOST_BUDGET_ENV}=.*give GiB .* or 0 to free every model"):
        default_host_budget()


def test_the_tokenizer_is_read_once_per_process(tiny, reference, monkeypatch, tmp_path):
    """Read once per folder, and again only when its files change."""
    reads = []
    original = transformers.AutoTokenizer.from_pretrained

    def counting(*args, **kwargs):
        reads.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    text_encoder._read_tokenizer.cache_clear()
    first = run("text_encoder", tiny, reference, quantization="none")
    second = run("text_encoder", tiny, reference, quantization="none")
    assert len(reads) == 1 and torch.equal(first, second)

    copy = tmp_path / "model"
    shutil.copytree(tiny.path, copy)
    source = resolve_model(str(copy))
    run("text_encoder", source, reference, quantization="none")
    assert len(reads) == 2, "another folder is another tokenizer"
    config = copy / "tokenizer" / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    run("text_encoder", source, reference, quantization="none")
    assert len(reads) == 3, "a changed file is read again"


def test_the_command_line_frees_every_model_after_its_stage(tiny_folder, tmp_path, load_spy, host_pool):
    """generate makes one image per process: nothing waits in host memory for a next one."""
    argv = ["generate", "--model", str(tiny_folder), "--out", str(tmp_path), "--steps", "1"]
    assert cli.main([*argv, "--device", "cpu", "--no-snapshot", "--no-quant-cache"]) == 0
    assert cache.pooled() == [] and load_spy.total() == 3
    assert load_spy.alive("text_encoder") == [False] and load_spy.alive("transformer") == [False]


def test_a_copy_for_a_run_leaves_the_home_copy_as_it_is():
    """bitsandbytes' Params4bit.to moves the weight's quant_state in place (on the GPU, T5-XXL's 70 MiB of
    absmax would stay there after the run); the run's copy gets its own, and a parameter stays one."""
    import bitsandbytes as bnb

    from pixart_lowvram.core.streaming import to_device

    layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.bfloat16, quant_type="nf4").to("cpu")  # quantizes
    home = layer.weight
    state = home.quant_state
    assert state.nested  # double quantization: the nested state must not move either
    meta = torch.device("meta")  # a device the copy can go to without a GPU
    moved = to_device(home, meta)
    assert moved.device == meta and moved.quant_state.absmax.device == meta
    assert home.quant_state is state and state.absmax.device.type == "cpu"
    assert state.state2.absmax.device.type == "cpu" and moved.quant_state.state2.absmax.device == meta
    bias = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    assert isinstance(to_device(bias, meta), torch.nn.Parameter)


def test_the_pool_says_what_it_holds_against_its_budget():
    pool = ModelCache(host_budget=1 << 30)
    assert pool.pool_summary().startswith(
        "host memory: 0 model(s) waiting for the next run, 0.0 MiB of 1.00 GiB"
    )
    use(pool, "a")
    summary = pool.pool_summary()
    assert "1 model(s) waiting" in summary and HOST_BUDGET_ENV in summary
    assert "no models kept between runs" in ModelCache(host_budget=0).pool_summary()
