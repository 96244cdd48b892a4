"""Batched guidance under ComfyUI's own sampler (the ``comfyui`` tier, in-process, CPU): KSampler's sampling
(``comfy.sample.sample``) on the pack's int8 MODEL with a long prompt and an empty negative runs one forward
per step, and its latents are the two passes' within the bound; the Batched Guidance node does the same for
ComfyUI core's own PixArt-Σ (Load Diffusion Model's loader on the smallest PixArt-Σ core builds: 1152-wide,
one block); equal lengths, which ComfyUI batches by itself, give the same bits as without it; images too
small for ComfyUI's PixArt are refused before sampling; ComfyUI's MultiGPU deep clone copies the MODEL."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from tolerances import GUIDANCE_COSINE

from pixart_lowvram.cli.random_model import build_random_pixart, save_single_file_transformer
from pixart_lowvram.core.models import resolve_model

pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)

SIZE = 272  # the smallest square ComfyUI's PixArt places its position embedding for (int8_model.refuse_small)
STEPS, CFG = 4, 4.5
PROMPT_TOKENS = 40  # a long prompt; the empty negative is its end token alone (1)


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI importable (CPU only); its modules stay imported, as in ComfyUI's own unit tests."""
    saved_path = list(sys.path)
    sys.path.insert(0, str(Path(os.environ["COMFYUI_PATH"]).resolve()))
    try:
        from comfy.cli_args import args

        saved_cpu, args.cpu = args.cpu, True
        import comfy.sample
        import comfy.samplers

        try:
            yield comfy
        finally:
            args.cpu = saved_cpu
    finally:
        sys.path[:] = saved_path


@pytest.fixture(scope="module")
def pack_model(comfy, tiny_folder, tmp_path_factory):
    from pixart_lowvram.core.sampler import SamplerSettings
    from pixart_lowvram.nodes import int8_model

    settings = SamplerSettings(
        resolve_model(str(tiny_folder)),
        device="cpu",
        precision=torch.float32,
        quant_cache=tmp_path_factory.mktemp("quantized"),
    )
    return int8_model.load(settings)


@pytest.fixture(scope="module")
def core_file(tmp_path_factory) -> Path:
    """The smallest PixArt-Σ ComfyUI core builds (its detection fixes the width at 1152): one block, as the
    single file Load Diffusion Model reads."""
    folder = build_random_pixart(
        tmp_path_factory.mktemp("model") / "tiny-core", "tiny-core", text_encoder=False
    )
    return save_single_file_transformer(folder, tmp_path_factory.mktemp("single") / "core.safetensors")


@pytest.fixture(scope="module")
def core_model(comfy, core_file):
    """ComfyUI core's own PixArt-Σ, loaded as Load Diffusion Model loads it."""
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(core_file))


def caption_width(model) -> int:
    return model.model.model_config.unet_config.get("caption_channels", 4096)  # PixArtMS's default


def conditioning(model, tokens: int, seed: int) -> list:
    """A CONDITIONING of ``tokens`` embeddings (unpadded, as PixArt's text encoders give it)."""
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, caption_width(model), generator=generator), {}]]


class Forwards:
    """``model_function_wrapper`` that counts the model's forwards and the batch of each."""

    def __init__(self):
        self.batches: list[int] = []

    def __call__(self, apply_model, args):
        self.batches.append(args["input"].shape[0])
        return apply_model(args["input"], args["timestep"], **args["c"])


def sample(
    comfy, model, negative_tokens: int = 1, size: int = SIZE, seed: int = 5
) -> tuple[torch.Tensor, list]:
    """KSampler's sampling (what its node calls) on ``model`` with a long prompt; the latents and the batch
    of each forward."""
    forwards = Forwards()
    model = model.clone()
    model.set_model_unet_function_wrapper(forwards)
    latent = torch.zeros(1, 4, size // 8, size // 8)
    noise = comfy.sample.prepare_noise(latent, seed)
    positive = conditioning(model, PROMPT_TOKENS, seed=1)
    negative = conditioning(model, negative_tokens, seed=2)
    with torch.inference_mode():
        latents = comfy.sample.sample(
            model, noise, STEPS, CFG, "euler", "normal", positive, negative, latent, seed=seed
        )
    return latents.float(), forwards.batches


def two_passes(model):
    """The MODEL as ComfyUI runs it by itself: no batching function."""
    from pixart_lowvram.nodes import batched_guidance

    plain = model.clone()
    plain.model_options.pop(batched_guidance.KEY, None)
    return plain


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_the_packs_model_runs_prompt_and_empty_negative_in_one_forward(comfy, pack_model):
    latents, batches = sample(comfy, pack_model)
    reference, reference_batches = sample(comfy, two_passes(pack_model))
    assert batches == [2] * STEPS, "one forward of both per step"
    assert reference_batches == [1] * (2 * STEPS), "ComfyUI alone runs two"
    assert cosine(latents, reference) >= GUIDANCE_COSINE[torch.float32]


def test_zero_padding_without_a_mask_is_not_the_two_passes(comfy, pack_model):
    """What the bound tells apart: the negative padded with zero embeddings to the prompt's length (so that
    ComfyUI batches it) is not the empty negative, since the padded keys take part in the softmax."""
    reference, _ = sample(comfy, two_passes(pack_model))
    negative = conditioning(pack_model, 1, seed=2)[0][0]
    padded = torch.cat([negative, torch.zeros(1, PROMPT_TOKENS - 1, negative.shape[2])], dim=1)
    forwards = Forwards()
    model = two_passes(pack_model)
    model.set_model_unet_function_wrapper(forwards)
    latent = torch.zeros(1, 4, SIZE // 8, SIZE // 8)
    with torch.inference_mode():
        zero_padded = comfy.sample.sample(
            model,
            comfy.sample.prepare_noise(latent, 5),
            STEPS,
            CFG,
            "euler",
            "normal",
            conditioning(pack_model, PROMPT_TOKENS, seed=1),
            [[padded, {}]],
            latent,
            seed=5,
        )
    assert forwards.batches == [2] * STEPS
    assert cosine(zero_padded.float(), reference) < GUIDANCE_COSINE[torch.float32]


def test_equal_lengths_give_what_comfyui_gives_by_itself(comfy, pack_model):
    latents, batches = sample(comfy, pack_model, negative_tokens=PROMPT_TOKENS)
    reference, reference_batches = sample(comfy, two_passes(pack_model), negative_tokens=PROMPT_TOKENS)
    assert batches == reference_batches == [2] * STEPS
    assert torch.equal(latents, reference)


def test_lengths_without_a_short_common_length_stay_two_passes(comfy, pack_model):
    from pixart_lowvram.nodes import batched_guidance

    tokens = batched_guidance.MAX_PADDED_TOKENS - 1  # with 40: a common length of 11960
    assert batched_guidance.padded_length(PROMPT_TOKENS, tokens) is None
    _latents, batches = sample(comfy, pack_model, negative_tokens=tokens)
    assert batches == [1] * (2 * STEPS)


def test_the_patch_node_batches_comfyuis_own_pixart(comfy, core_model):
    from pixart_lowvram.nodes.batched_guidance import PixArtBatchedGuidance

    patched = PixArtBatchedGuidance.execute(core_model).result[0]
    assert patched is not core_model and "sampler_calc_cond_batch_function" not in core_model.model_options
    latents, batches = sample(comfy, patched)
    reference, reference_batches = sample(comfy, core_model)
    assert batches == [2] * STEPS and reference_batches == [1] * (2 * STEPS)
    assert cosine(latents, reference) >= GUIDANCE_COSINE[torch.float32]


def test_the_patch_node_on_comfyuis_pixart_in_fp16(comfy, core_file):
    """The same with float16 weights (Load Diffusion Model's weight dtype, as on a GPU), on the CPU."""
    import comfy.sd

    from pixart_lowvram.nodes.batched_guidance import PixArtBatchedGuidance

    half = comfy.sd.load_diffusion_model(str(core_file), model_options={"dtype": torch.float16})
    assert half.model.get_dtype() == torch.float16
    latents, batches = sample(comfy, PixArtBatchedGuidance.execute(half).result[0])
    reference, _ = sample(comfy, half)
    assert batches == [2] * STEPS
    assert cosine(latents, reference) >= GUIDANCE_COSINE[torch.float16]


def test_the_patch_node_refuses_a_model_that_is_not_pixart(comfy):
    import comfy.model_patcher

    from pixart_lowvram.nodes.batched_guidance import PixArtBatchedGuidance

    other = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"model: Batched Guidance .* takes a PixArt-Σ MODEL, not a Linear"):
        PixArtBatchedGuidance.execute(other)


def test_a_function_set_before_the_patch_runs_behind_it(comfy, core_model):
    from pixart_lowvram.nodes.batched_guidance import PixArtBatchedGuidance

    seen = []

    def before(args):
        seen.append(len(args["conds"]))
        return comfy.samplers.calc_cond_batch(
            args["model"], args["conds"], args["input"], args["sigma"], args["model_options"]
        )

    model = core_model.clone()
    model.set_model_sampler_calc_cond_batch_function(before)
    _latents, batches = sample(comfy, PixArtBatchedGuidance.execute(model).result[0])
    assert seen == [2] * STEPS and batches == [2] * STEPS


def test_a_small_image_is_refused_before_sampling(comfy, pack_model):
    with pytest.raises(ValueError, match=r"latent_image: 256×256 is too small .* at least 272×272") as caught:
        sample(comfy, pack_model, size=256)
    assert "\n" not in str(caught.value)


def test_multigpu_deep_clone_builds_a_fresh_model_that_computes_the_same(comfy, pack_model):
    """ComfyUI's MultiGPU CFG Split copies a MODEL with ``deepclone_multigpu`` (v0.33 on): the pack's
    builds a fresh one from its ``cached_patcher_init``, with the same numbers and the same options."""
    from pixart_lowvram.nodes import batched_guidance

    if not hasattr(pack_model, "deepclone_multigpu"):
        pytest.skip("this ComfyUI has no MultiGPU deep clone")
    import comfy.multigpu

    copy = pack_model.deepclone_multigpu(new_load_device=torch.device("cpu"))
    assert copy.model is not pack_model.model
    assert batched_guidance.applied(copy)
    latents, batches = sample(comfy, copy)
    reference, _ = sample(comfy, pack_model)
    assert batches == [2] * STEPS
    assert torch.equal(latents, reference)  # the same weights and kernels on the same data
    # The node itself: on a CPU-only machine there is no other device to copy to, and the MODEL passes.
    split = comfy.multigpu.create_multigpu_deepclones(pack_model, 2, reuse_loaded=True)
    assert batched_guidance.applied(split)


def test_the_schedule_stays_on_the_cpu_wherever_the_model_moves(comfy, core_model):
    """KSampler computes its sigmas before the model loads: the patch's tables are the CPU's own values and
    are not buffers, so moving the model (here to the meta device) leaves them where they are, while
    ComfyUI's own move with the model."""
    import comfy.samplers

    from pixart_lowvram.nodes import repeatable
    from pixart_lowvram.nodes.batched_guidance import PixArtBatchedGuidance

    patched = PixArtBatchedGuidance.execute(core_model).result[0]
    original = core_model.get_model_object("model_sampling")
    stable = patched.get_model_object("model_sampling")
    assert repeatable.applied(patched) and not repeatable.applied(core_model)
    assert isinstance(stable, type(original)) and stable is not original
    assert torch.equal(stable.log_sigmas, original.log_sigmas) and stable.sigmas.device.type == "cpu"
    assert "sigmas" not in dict(stable.named_buffers()) and "log_sigmas" not in stable.state_dict()
    for scheduler in ("normal", "karras", "simple", "sgm_uniform"):
        assert torch.equal(
            comfy.samplers.calculate_sigmas(stable, scheduler, 20),
            comfy.samplers.calculate_sigmas(original, scheduler, 20),
        ), scheduler
    holder = torch.nn.Module()
    holder.model_sampling, holder.original = stable, repeatable.copy.deepcopy(original)
    holder.to(torch.device("meta"))
    assert holder.original.sigmas.device.type == "meta"
    assert stable.sigmas.device.type == stable.log_sigmas.device.type == "cpu"
    # A buffer registered under a table's name (ComfyUI's set_sigmas; Dynamic VRAM restoring its backups
    # through the object patch) is taken as the table, on the CPU.
    stable.register_buffer("sigmas", original.sigmas.clone(), persistent=False)
    assert "sigmas" not in dict(stable.named_buffers()) and torch.equal(stable.sigmas, original.sigmas)


def test_the_schedule_patch_samples_what_comfyui_samples(comfy, pack_model):
    """On the CPU, ComfyUI's tables and the patch's are the same numbers on the same device: the same bits."""
    from pixart_lowvram.nodes import repeatable

    assert repeatable.applied(pack_model)
    plain = pack_model.clone()
    plain.object_patches.pop(repeatable.NAME)
    assert not repeatable.applied(plain)
    latents, _ = sample(comfy, pack_model)
    reference, _ = sample(comfy, plain)
    assert torch.equal(latents, reference)


def test_the_attention_kernel_is_settled_once_per_device_before_the_first_step(
    comfy, pack_model, monkeypatch
):
    """Before a run, one call of ComfyUI's own attention function on the MODEL's device (large enough for
    ComfyUI to apply its backend order), once per process and device; none on the CPU."""
    import comfy.ops

    from pixart_lowvram.nodes import repeatable

    calls = []
    monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention", lambda q, k, v: calls.append(q))
    monkeypatch.setattr(repeatable, "_settled", set())
    assert repeatable.settle_attention in pack_model.get_all_callbacks("on_pre_run")

    class OnMeta:
        load_device = torch.device("meta")

    repeatable.settle_attention(pack_model)  # the CPU
    assert calls == []
    repeatable.settle_attention(OnMeta())
    repeatable.settle_attention(OnMeta())
    assert len(calls) == 1 and calls[0].device.type == "meta" and calls[0].nelement() >= 1024 * 128
