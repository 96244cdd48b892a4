"""GPU tier (``pytest -m gpu``): memory figures on CUDA, the allocator snapshot, and device memory
returned by each stage. Deselected by default."""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from tolerances import assert_close

from pixart_lowvram.core import measure, sampler, sampler_settings, text_encoder, transformer, vae
from pixart_lowvram.core.pool import cache

pytestmark = pytest.mark.gpu

# compute fp16 unless a test says otherwise: auto is fp8 on Hopper (test_auto_compute_runs_the_cards_measured_path).
SETTINGS = {"width": 64, "height": 64, "steps": 2, "seed": 7, "compute": "fp16"}


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA; run it on the GPU machine (pytest -m gpu)")
    return torch.device("cuda")


def run_chain(source, device, report=None, **options):
    encoding = text_encoder.EncoderSettings(source, device=device, **options)
    embeds = text_encoder.encode(encoding, "a red cat", "dark", report=report)
    sampling = sampler_settings.SamplerSettings(source, **SETTINGS, device=device, **options)
    latents = sampler.sample(sampling, embeds, report=report)
    return vae.decode(vae.DecoderSettings(source, device=device, **options), latents, report=report)


def test_stages_report_cuda_peaks(tiny, cuda):
    report = measure.MemoryReport()
    images = run_chain(tiny, cuda, report)
    assert images.device.type == "cpu" and images.dtype == torch.float32
    assert torch.isfinite(images).all()
    assert [r.stage for r in report.stages] == ["t5_encode", "sample", "vae_decode"]
    for record in report.stages:
        assert record.device.startswith("cuda")
        assert isinstance(record.peak_allocated, int) and record.peak_allocated > 0
        assert isinstance(record.peak_reserved, int) and record.peak_reserved >= record.peak_allocated
        assert record.error is None
    assert report.peak_allocated == max(r.peak_allocated for r in report.stages)
    assert measure.NO_CUDA not in report.markdown()


def test_snapshot_pickle_is_written(tiny, cuda, tmp_path):
    assert measure.history.ensure("test") is True
    try:
        text_encoder.encode(text_encoder.EncoderSettings(tiny, device=cuda), "a red cat")
    finally:
        # dump() also stops the recording.
        dumped = measure.history.dump(tmp_path / "snapshot.pickle")
    snapshot = pickle.loads((tmp_path / "snapshot.pickle").read_bytes())
    assert snapshot["segments"] or snapshot["device_traces"]
    assert dumped.keys() == snapshot.keys()


def _settled(run) -> int:
    """Device memory allocated after ``run``, once a first run has created what stays for the
    process (cuBLAS workspaces, kernels' buffers)."""
    run()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("stage", ["text_encoder", "transformer", "vae"])
def test_each_stage_returns_device_memory(tiny, reference, cuda, stage):
    def run(keep_loaded=False):
        if stage == "text_encoder":
            settings = text_encoder.EncoderSettings(tiny, device=cuda, keep_loaded=keep_loaded)
            cache.forget_results()  # T5 runs, not the remembered embeddings
            return text_encoder.encode(settings, "a red cat")
        if stage == "transformer":
            settings = sampler_settings.SamplerSettings(
                tiny, **SETTINGS, device=cuda, keep_loaded=keep_loaded
            )
            return sampler.sample(settings, reference.embeds)
        return vae.decode(vae.DecoderSettings(tiny, device=cuda, keep_loaded=keep_loaded), reference.latents)

    baseline = _settled(run)
    assert _settled(run) == baseline, "a stage left device memory allocated"

    run(keep_loaded=True)
    assert torch.cuda.memory_allocated() > baseline, "keep_loaded keeps the model on the device"
    assert cache.clear() == 1
    assert torch.cuda.memory_allocated() == baseline


@pytest.mark.parametrize(
    ("stage", "options"),
    [
        ("text_encoder", {}),
        ("text_encoder", {"low_vram": True}),
        ("transformer", {}),
        ("transformer", {"low_vram": True}),
        ("transformer", {"fast": True, "compute": "fp16"}),  # fp16 + fast (auto is fp8 on Hopper)
        ("vae", {}),
    ],
    ids=["t5", "t5-low-vram", "transformer", "transformer-low-vram", "transformer-fast", "vae"],
)
def test_pooled_models_leave_the_gpu_and_come_back_bit_identical(
    tiny, reference, cuda, host_pool, load_spy, stage, options
):
    """With the host-memory pool on (the library's default), a stage's model is off the GPU after the
    stage and back on it for the next run, loaded once, with the same output bit for bit (the compiled
    fast path too)."""

    def run():
        if stage == "text_encoder":
            settings = text_encoder.EncoderSettings(tiny, device=cuda, **options)
            cache.forget_results()  # T5 runs, not the remembered embeddings
            return text_encoder.encode(settings, "a red cat").prompt_embeds
        if stage == "transformer":
            settings = sampler_settings.SamplerSettings(tiny, device=cuda, **SETTINGS | options)
            return sampler.sample(settings, reference.embeds)
        return vae.decode(vae.DecoderSettings(tiny, device=cuda), reference.latents)

    first = run()
    (key,) = cache.pooled()
    model = load_spy.last(key[0])()
    on_cpu = [t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()]]
    assert all(on_cpu), "the model stayed on the GPU"
    run()
    # Measured after two runs: libraries allocate a little state on first use (43 KB for T5 on an H200,
    # with every tensor of the model in CPU memory); a further run must leave nothing more.
    baseline = torch.cuda.memory_allocated()
    third = run()
    assert load_spy.count(key[0]) == 1 and torch.equal(first, third)
    assert torch.cuda.memory_allocated() == baseline
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


def test_a_pooled_t5_has_its_tied_embedding_on_the_gpu_once(tiny, cuda, host_pool):
    """T5's shared and embed_tokens are one weight: moved back from host memory, still one."""
    settings = text_encoder.EncoderSettings(tiny, device=cuda, quantization="none")
    text_encoder.encode(settings, "a red cat")
    (key,) = cache.pooled()
    copy, _size = cache._pool[key]
    copy.to(cuda)
    try:
        assert copy.model.shared.weight is copy.model.encoder.embed_tokens.weight
        assert copy.model.shared.weight.device.type == "cuda"
    finally:
        copy.back()


def test_failed_sample_returns_device_memory(tiny, reference, cuda):
    settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, device=cuda)

    def run():
        return sampler.sample(settings, reference.embeds)

    def stop(step, total, latents):
        raise RuntimeError("stop")

    baseline = _settled(run)
    with pytest.raises(RuntimeError, match="stop"):
        sampler.sample(settings, reference.embeds, on_progress=stop)
    gc.collect()
    assert torch.cuda.memory_allocated() == baseline


def test_cli_demo_on_cuda_writes_snapshot(tmp_path, cuda):
    env = {**os.environ, "PIXART_LOWVRAM_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pixart_lowvram",
            "demo",
            "--model-dir",
            str(tmp_path / "model"),
            "--out",
            str(out),
            "--steps",
            "2",
            "--device",
            "cuda",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "pixart_00001_memory.json").read_text())
    assert all(isinstance(s["peak_allocated"], int) and s["peak_allocated"] > 0 for s in report["stages"])
    assert isinstance(report["peak_allocated"], int)
    assert measure.NO_CUDA not in (out / "pixart_00001_memory.md").read_text()
    assert (out / "pixart_00001_memory.pickle").stat().st_size > 0
    assert (out / "pixart_00001.png").is_file()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("stage", ["text_encoder", "transformer"])
def test_low_vram_streams_one_block_at_a_time_and_matches(tiny, reference, cuda, stage, monkeypatch):
    """While a block runs, only it and the next (prefetched) have weights on the GPU; the result
    matches the model loaded whole; nothing stays allocated afterwards."""
    from pixart_lowvram.core import estimates, streaming

    monkeypatch.setattr(estimates, "LOW_VRAM_BUDGET", 0)  # the int8 transformer streams though it fits

    on_gpu: list[list[int]] = []
    original = streaming.BlockStreamer.__init__

    def init(self, blocks, *args, **kwargs):
        original(self, blocks, *args, **kwargs)
        for block in blocks:

            def spy(_module, _args, _streamer=self):
                torch.cuda.synchronize()
                on_gpu.append(
                    [
                        i
                        for i, b in enumerate(_streamer.blocks)
                        if any(t.device.type == "cuda" for t in b.module.parameters())
                    ]
                )

            block.register_forward_pre_hook(spy)  # runs after the streamer's own pre-hook

    monkeypatch.setattr(streaming.BlockStreamer, "__init__", init)

    def run(low_vram):
        if stage == "text_encoder":
            settings = text_encoder.EncoderSettings(tiny, device=cuda, low_vram=low_vram)
            return text_encoder.encode(settings, "a red cat", "dark").prompt_embeds
        settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, device=cuda, low_vram=low_vram)
        return sampler.sample(settings, reference.embeds)

    whole = run(False)
    baseline = _settled(lambda: run(True))
    streamed = run(True)
    assert torch.cuda.memory_allocated() == baseline, "the streamed stage left device memory allocated"
    assert _cosine(streamed, whole) > 0.999
    assert on_gpu and all(len(loaded) <= 2 for loaded in on_gpu), on_gpu
    count = tiny.config(stage)["num_layers"]
    assert [loaded[0] for loaded in on_gpu[:count]] == list(range(count))


@pytest.mark.parametrize("quantization", ["qint8", "qfloat8"])
def test_plain_and_dense_layers_agree_and_follow_quanto(tiny, reference, cuda, quantization):
    """On CUDA the sampler's plain layers, expanding per call or holding the expanded weights for the run,
    give the same latents bit for bit, and close to quanto's own CUDA kernels'; the dense run holds the
    expanded weights during the run only. quanto runs qfloat8 weights on an Ampere or newer GPU through its
    Marlin fp8 kernel, which scales the fp32 sums where the plain layer (like quanto's generic product)
    multiplies with the weight expanded to fp16 first: the rounding differs more (cosine 0.9994 on the
    H200 after two steps of the tiny model), hence its looser bound."""
    from diffusers import PixArtSigmaPipeline

    from pixart_lowvram.core.quant import TRANSFORMER_SCHEMES
    from pixart_lowvram.core.schedulers import make_scheduler

    settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, device=cuda, quantization=quantization)
    scheme = TRANSFORMER_SCHEMES[quantization]

    def quantized_model():
        return scheme.after_load(
            transformer.read(settings.transformer, tiny.folder(["transformer"]) / "transformer")
        ).eval()

    # Two reads of the same weights (quanto's tensors cannot be deep-copied). The plain layers are made on
    # the CPU, as the sampler makes them (quanto may hold its CUDA weights in other, packed tensor types);
    # quanto's own model runs on CUDA as quanto runs it there.
    quantized, plain_model = quantized_model(), quantized_model()
    assert scheme.plain_modules(plain_model) > 0
    models = {"quanto": quantized.to(cuda), "plain": plain_model.to(cuda)}
    embeds = reference.embeds

    def run(name):
        pipe = PixArtSigmaPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=None,
            transformer=models[name],
            scheduler=make_scheduler("dpmsolver++", tiny.config("scheduler")),
        )
        pipe.set_progress_bar_config(disable=True)
        latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
        return pipe(
            negative_prompt=None,
            prompt_embeds=embeds.prompt_embeds.to(cuda, settings.dtype),
            prompt_attention_mask=embeds.prompt_mask.to(cuda),
            negative_prompt_embeds=embeds.negative_embeds.to(cuda, settings.dtype),
            negative_prompt_attention_mask=embeds.negative_mask.to(cuda),
            latents=latents.to(cuda, settings.dtype),
            width=64,
            height=64,
            num_inference_steps=SETTINGS["steps"],
            guidance_scale=4.5,
            output_type="latent",
            use_resolution_binning=False,
            return_dict=False,
        )[0]

    with torch.inference_mode():
        by_quanto, plain = run("quanto"), run("plain")
        before = torch.cuda.memory_allocated(cuda)
        with scheme.dense_weights(plain_model):
            assert torch.cuda.memory_allocated(cuda) - before >= scheme.dense_bytes(plain_model) > 0
            dense = run("plain").cpu()  # on the CPU: the latents' own block is not the weights'
        assert torch.cuda.memory_allocated(cuda) == before
    assert torch.equal(dense, plain.cpu())  # exact: the same expansion and products on the same values
    assert _cosine(plain, by_quanto) > (0.999 if quantization == "qfloat8" else 0.9999)


@pytest.mark.parametrize("low_vram", [False, True])
def test_fast_path_compiles_matches_and_returns_memory(tiny, reference, cuda, low_vram):
    """The fast sampler path with inductor on the GPU (streamed too): the quantized path's latents, and
    nothing left allocated afterwards."""
    # compute fp16: auto is fp8 on Hopper (test_8bit_compute_* cover that path).
    options = {**SETTINGS, "device": cuda, "quantization": "qint8", "low_vram": low_vram, "compute": "fp16"}
    quantized = sampler_settings.SamplerSettings(tiny, **options)
    compiled = sampler_settings.SamplerSettings(tiny, **options, fast=True)
    quanto = sampler.sample(quantized, reference.embeds)
    baseline = _settled(lambda: sampler.sample(compiled, reference.embeds))
    fast = sampler.sample(compiled, reference.embeds)
    assert torch.cuda.memory_allocated() == baseline, "the fast path left device memory allocated"
    assert _cosine(fast, quanto) > 0.9999


@pytest.mark.parametrize("stage", ["sample", "vae_decode"])
def test_forced_out_of_memory_names_the_stage_and_returns_memory(tiny, reference, cuda, stage):
    """With the allocator capped a little above what is in use, a large sample or an untiled decode runs
    out of memory: the error names the stage and what to change, the memory comes back, and the next run
    (uncapped) succeeds."""

    def run(big: bool):
        if stage == "sample":
            size = 2048 if big else SETTINGS["width"]
            settings = sampler_settings.SamplerSettings(
                tiny, **{**SETTINGS, "width": size, "height": size}, device=cuda
            )
            return sampler.sample(settings, reference.embeds)
        latents = torch.zeros(1, 4, 256, 256) if big else reference.latents
        return vae.decode(vae.DecoderSettings(tiny, device=cuda, tiling="off"), latents)

    run(big=False)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(cuda)
    total = torch.cuda.get_device_properties(cuda).total_memory
    index = torch.cuda.current_device()  # (the fraction wants a device index)
    torch.cuda.set_per_process_memory_fraction((before + 64 * 2**20) / total, index)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError) as info:
            run(big=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    message = str(info.value)
    assert f"stage {stage} ran out of GPU memory" in message, message
    assert ("tiling" if stage == "vae_decode" else "low_vram") in message and (
        "free the GPU memory other models hold" in message
    )
    # The exception is still alive here: it must not hold the model. What it may hold are the sampler's own
    # few hundred bytes (the scheduler's timesteps on the device, in sample()'s frame: 512 B measured on an
    # H200), until it is dropped, as ComfyUI drops it once the error is shown.
    assert torch.cuda.memory_allocated(cuda) - before < 2**20
    del info
    gc.collect()
    assert torch.cuda.memory_allocated(cuda) == before
    run(big=False)


def test_the_decoder_in_strips_keeps_the_image_and_saves_memory_at_1024(tiny, cuda, monkeypatch):
    """The SDXL VAE (the tiny model's is full size) decoding 1024² in bf16: its convolutions in strips give
    the image of whole convolutions (bit for bit as measured on an H200; another kernel
    for a strip's height may round otherwise, so bounded as two computations of one bf16 network,
    tests/tolerances.py), with cuDNN's channels-last copies of the widest activations (1 GiB at 256
    channels and full resolution) gone from the peak."""
    model = vae._load(vae.DecoderSettings(tiny, device=cuda, tiling="off"))
    latents = torch.randn(1, 4, 128, 128, generator=torch.Generator().manual_seed(5))
    latents = latents.to(cuda, torch.bfloat16)

    def decode(model, latents) -> tuple[int, torch.Tensor]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.inference_mode():
            image = model.decode(latents, return_dict=False)[0].cpu()
        return torch.cuda.max_memory_allocated() - before, image

    strips_peak, strips = decode(model, latents)
    monkeypatch.setattr(vae, "STRIP_BYTES", 2**62)  # every convolution whole
    whole_peak, whole = decode(model, latents)
    del model, latents
    gc.collect()
    torch.cuda.empty_cache()
    assert_close(strips, whole, network=True)
    assert strips_peak < whole_peak - 2**30 // 2, (strips_peak / 2**30, whole_peak / 2**30)


def test_a_lora_on_cuda_dense_or_per_call_and_nothing_left_after(
    tiny, tiny_folder, reference, cuda, tmp_path, monkeypatch
):
    """A LoRA on CUDA gives the same latents whether the run holds the expanded weights (with the LoRA's sum
    in them, once) or each layer expands and adds per call; it changes the latents; and after the run the
    GPU holds what it held before (no expanded or patched weight stays)."""
    import dataclasses

    from pixart_lowvram.cli.random_model import save_random_lora
    from pixart_lowvram.core import lora, measure

    path = save_random_lora(tiny_folder, tmp_path / "lora.safetensors", scale=0.15)
    settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, device=cuda, quantization="qint8")
    with_lora = dataclasses.replace(settings, loras=(lora.LoraSpec(path),))
    plain = sampler.sample(settings, reference.embeds)
    # After a first run: what stays allocated from then on (cuBLAS's workspace) is the baseline.
    before = torch.cuda.memory_allocated(cuda)
    dense = sampler.sample(with_lora, reference.embeds)
    assert torch.cuda.memory_allocated(cuda) == before
    monkeypatch.setattr(measure, "device_room", lambda device: 0)  # no room: expanded per call
    per_call = sampler.sample(with_lora, reference.embeds)
    assert torch.equal(dense, per_call)  # exact: the same expansion and sum on the same values
    assert _cosine(dense, plain) < 0.9999
    assert torch.cuda.memory_allocated(cuda) == before


def test_remembered_embeddings_on_cuda_same_image_and_nothing_on_the_gpu(tiny, cuda, load_spy):
    """T5 on CUDA encodes a negative prompt once: a later prompt with the same negative encodes only itself
    and gives the bits a fresh encode gives; a prompt whose texts were both seen loads nothing; the
    remembered embeddings live in CPU memory, so after the stage (and after Free VRAM) the GPU holds what it
    held before."""
    from pixart_lowvram.core.pool import free_all

    settings = text_encoder.EncoderSettings(tiny, device=cuda)
    text_encoder.encode(settings, "a red cat", "dark")
    before = torch.cuda.memory_allocated(cuda)
    remembered = text_encoder.encode(settings, "a lighthouse", "dark")
    assert remembered.negative_embeds.device.type == "cpu"
    again = text_encoder.encode(settings, "a lighthouse", "dark")
    assert load_spy.count("text_encoder") == 2, "the third encode loaded nothing"
    cache.forget_results()
    fresh = text_encoder.encode(settings, "a lighthouse", "dark")
    for name in ("prompt_embeds", "negative_embeds", "prompt_mask", "negative_mask"):
        assert torch.equal(getattr(remembered, name), getattr(fresh, name)), name
        assert torch.equal(getattr(again, name), getattr(fresh, name)), name
    assert torch.cuda.memory_allocated(cuda) == before
    free_all()
    assert torch.cuda.memory_allocated(cuda) <= before


def test_step_cache_on_cuda_bounded_and_nothing_left(tiny, reference, cuda, caplog):
    """The sampler's step_cache on CUDA (the qint8 transformer with its weights held expanded): below every
    step's change the uncached bits; at 0.5 fewer full steps and latents near the uncached ones; the same
    seed gives the same latents; no hook and nothing allocated stay after the run (with fast, too)."""
    import logging

    options = {**SETTINGS, "steps": 10, "device": cuda, "quantization": "qint8", "compute": "fp16"}
    uncached = sampler.sample(sampler_settings.SamplerSettings(tiny, **options), reference.embeds)
    before = torch.cuda.memory_allocated(cuda)
    tiny_threshold = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **options, step_cache=1e-9), reference.embeds
    )
    assert torch.equal(tiny_threshold, uncached)
    with caplog.at_level(logging.INFO, logger="pixart_lowvram.core.transformer_run"):
        cached = sampler.sample(
            sampler_settings.SamplerSettings(tiny, **options, step_cache=0.5), reference.embeds
        )
    assert "ran every block on" in caplog.text and "on 10 of 10 steps" not in caplog.text
    assert torch.equal(
        cached,
        sampler.sample(sampler_settings.SamplerSettings(tiny, **options, step_cache=0.5), reference.embeds),
    )
    assert 0.9 < _cosine(cached, uncached) < 1.0
    assert torch.cuda.memory_allocated(cuda) == before
    fast = sampler_settings.SamplerSettings(tiny, **options, step_cache=0.5, fast=True)
    _settled(lambda: sampler.sample(fast, reference.embeds))
    assert torch.equal(
        sampler.sample(sampler_settings.SamplerSettings(tiny, **options), reference.embeds), uncached
    )


@pytest.mark.parametrize("fused", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("compute", ["int8", "fp8"])
def test_8bit_compute_on_cuda_close_to_fp16_with_lora_and_nothing_left(
    tiny, tiny_folder, reference, cuda, tmp_path, monkeypatch, compute, fused
):
    """Each 8-bit compute path compiled with inductor on the GPU, with and without the fused quantization
    kernels: latents close to the fp16 path's, the same bits twice, a LoRA beside the 8-bit products changes
    them and strength 0 gives them back, and after the runs and Free VRAM's call the GPU holds what it held
    before."""
    import dataclasses

    from pixart_lowvram.cli.random_model import save_random_lora
    from pixart_lowvram.core import lora
    from pixart_lowvram.core.pool import free_all
    from pixart_lowvram.core.quant import block as fused_block
    from pixart_lowvram.core.quant import compute as compute_paths

    monkeypatch.setenv(fused_block.VARIABLE, fused)

    if reason := compute_paths.unable(compute, cuda):
        pytest.skip(reason)
    # 128 px: 128 rows a call with guidance, above the rows at which a call takes the fp16 path.
    options = {**SETTINGS, "width": 128, "height": 128, "device": cuda, "quantization": "qint8"}
    fp16 = sampler.sample(sampler_settings.SamplerSettings(tiny, **options), reference.embeds)
    before = torch.cuda.memory_allocated(cuda)
    settings = sampler_settings.SamplerSettings(tiny, **options | {"compute": compute})
    first = sampler.sample(settings, reference.embeds)
    assert torch.equal(first, sampler.sample(settings, reference.embeds))
    assert 0.99 < _cosine(first, fp16) < 1
    path = save_random_lora(tiny_folder, tmp_path / "lora.safetensors", scale=0.15)
    on = sampler.sample(dataclasses.replace(settings, loras=(lora.LoraSpec(path),)), reference.embeds)
    off = sampler.sample(dataclasses.replace(settings, loras=(lora.LoraSpec(path, 0.0),)), reference.embeds)
    assert _cosine(on, first) < 0.9999
    assert torch.equal(off, first)
    free_all()
    assert torch.cuda.memory_allocated(cuda) <= before


def test_auto_compute_runs_the_cards_measured_path(tiny, reference, cuda):
    """compute auto (the default): the card's measured path (fp8 on compute capability 9.0, fp16
    elsewhere; fp16 with low_vram), ``fast`` or not, its latents close to fp16's, nothing left after the run."""
    from pixart_lowvram.core.pool import free_all
    from pixart_lowvram.core.quant import compute as compute_paths

    options = {
        **SETTINGS,
        "width": 128,
        "height": 128,
        "device": cuda,
        "quantization": "qint8",
        "compute": "auto",
    }
    expected = compute_paths.resolve("auto", cuda, "qint8", eight_bit=True)
    auto = sampler_settings.SamplerSettings(tiny, **options)
    assert auto.transformer.compute == expected
    assert sampler_settings.SamplerSettings(tiny, **options, fast=True).transformer.compute == expected
    assert sampler_settings.SamplerSettings(tiny, **options, low_vram=True).transformer.compute == "fp16"
    fp16 = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **options | {"compute": "fp16"}), reference.embeds
    )
    before = torch.cuda.memory_allocated(cuda)
    latents = sampler.sample(auto, reference.embeds)
    assert 0.99 < _cosine(latents, fp16) <= 1
    free_all()
    assert torch.cuda.memory_allocated(cuda) <= before


@pytest.mark.parametrize("compute", ["fp8", "int8", "fp16"])
def test_a_compiled_run_replays_one_cuda_graph_a_step_with_the_same_latents(
    tiny, reference, cuda, monkeypatch, caplog, compute
):
    """A compiled run (an 8-bit compute, or fp16 with fast) captures its forward once and replays it for the
    later steps: the same kernels on the same inputs as without the graph (PIXART_LOWVRAM_CUDA_GRAPH=0), so
    the same latents; no capture failed; after the runs and Free VRAM's call the GPU holds what it held
    before."""
    from graph_stand_in import with_and_without_graph

    from pixart_lowvram.core.pool import free_all
    from pixart_lowvram.core.quant import compute as compute_paths

    if compute != "fp16" and (reason := compute_paths.unable(compute, cuda)):
        pytest.skip(reason)
    options = {**SETTINGS, "width": 128, "height": 128, "steps": 5, "device": cuda, "quantization": "qint8"}
    settings = sampler_settings.SamplerSettings(tiny, **options, compute=compute, fast=compute == "fp16")
    assert settings.compiled
    before = torch.cuda.memory_allocated(cuda)
    plain, graphed, again = with_and_without_graph(
        lambda: sampler.sample(settings, reference.embeds), monkeypatch, caplog
    )
    assert torch.equal(graphed, plain)
    assert torch.equal(again, graphed)
    free_all()
    assert torch.cuda.memory_allocated(cuda) <= before
