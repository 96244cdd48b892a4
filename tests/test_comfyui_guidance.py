"""Batched guidance under ComfyUI's own sampler (the ``comfyui`` tier, in-process, CPU): KSampler's sampling
(``comfy.sample.sample``) on the pack's int8 MODEL with a long prompt and an empty negative runs one forward
per step, and its latents are the two passes' within the bound; the Batched Guidance node does the same for
ComfyUI core's own PixArt-Σ (Load Diffusion Model's loader on the smallest PixArt-Σ core builds: 1152-wide,
one block); equal lengths, which ComfyUI batches by itself, give the same bits as without it; images too
small for ComfyUI's PixArt are refused before sampling; ComfyUI's MultiGPU deep clone copies the MODEL.
And the MODEL's runs: its forward (diffusers' blocks over its layers) against ComfyUI's, its LoRAs folded
against ComfyUI's sum, keep_loaded off leaving ComfyUI's loaded models after each run, and its layers'
host copies in CPU memory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from tolerances import GUIDANCE_COSINE, relative_error

from pixart_lowvram.cli.random_model import build_random_pixart, save_single_file_transformer
from pixart_lowvram.core.models import resolve_model

pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)

SIZE = 272  # the smallest square ComfyUI's PixArt places its position embedding for (int8_model.build.refuse_small)
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


def int8_model_of(tiny_folder, tmp_path_factory, **choices):
    """The int8 Model Loader's MODEL of the tiny model on the CPU, in float32."""
    from pixart_lowvram.core.transformer import TransformerSettings
    from pixart_lowvram.nodes import int8_model

    keep_loaded = choices.pop("keep_loaded", False)
    settings = TransformerSettings(
        resolve_model(str(tiny_folder)),
        device="cpu",
        precision=torch.float32,
        quant_cache=tmp_path_factory.mktemp("quantized"),
        **choices,
    )
    return int8_model.load(settings, keep_loaded)


@pytest.fixture(scope="module")
def pack_model(comfy, tiny_folder, tmp_path_factory):
    return int8_model_of(tiny_folder, tmp_path_factory)


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
    from pixart_lowvram.nodes.int8_model import guidance as batched_guidance

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
    from pixart_lowvram.nodes.int8_model import guidance as batched_guidance

    tokens = batched_guidance.MAX_PADDED_TOKENS - 1  # with 40: a common length of 11960
    assert batched_guidance.padded_length(PROMPT_TOKENS, tokens) is None
    _latents, batches = sample(comfy, pack_model, negative_tokens=tokens)
    assert batches == [1] * (2 * STEPS)


def test_the_conds_are_made_ready_once_per_run_and_let_go_at_its_end(comfy, pack_model, monkeypatch):
    """ComfyUI's calc_cond_batch gets the same conditioning objects at every step of a run, padded and on the
    latents' device (not copied there again each step), and the MODEL's guidance lets them go when the run
    ends (ON_CLEANUP)."""
    from pixart_lowvram.nodes.int8_model import guidance as batched_guidance

    calc_cond_batch = comfy.samplers.calc_cond_batch
    steps = []

    def recording(model, conds, x_in, timestep, model_options):
        steps.append((model_options[batched_guidance.KEY], [c for cond in conds if cond for c in cond], x_in))
        return calc_cond_batch(model, conds, x_in, timestep, model_options)

    monkeypatch.setattr(comfy.samplers, "calc_cond_batch", recording)
    sample(comfy, pack_model)
    assert len(steps) == STEPS
    guidance, first, _x = steps[0]
    assert len(first) == 2
    for _guidance, conds, x_in in steps:
        assert [id(c) for c in conds] == [id(c) for c in first]
        for cond in conds:
            cross = cond["model_conds"][batched_guidance.CROSS_ATTN]
            assert isinstance(cross, batched_guidance.PaddedCrossAttn) and cross.cond.device == x_in.device
    assert guidance.ready == {}


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
    builds a fresh one from its ``cached_patcher_init``, with the same numbers and the same options, its
    forward over its own layers."""
    from pixart_lowvram.nodes.int8_model import forward as pack_forward
    from pixart_lowvram.nodes.int8_model import guidance as batched_guidance

    if not hasattr(pack_model, "deepclone_multigpu"):
        pytest.skip("this ComfyUI has no MultiGPU deep clone")
    import comfy.multigpu

    copy = pack_model.deepclone_multigpu(new_load_device=torch.device("cpu"))
    assert copy.model is not pack_model.model
    assert batched_guidance.applied(copy)
    # Its forward runs its own layers (the clone got the original's object patches); a plain clone shares.
    forwards = (copy.object_patches[pack_forward.OBJECT], pack_model.object_patches[pack_forward.OBJECT])
    assert forwards[0].pixart() is copy.model.diffusion_model
    assert forwards[1].pixart() is pack_model.model.diffusion_model
    assert pack_model.clone().object_patches[pack_forward.OBJECT] is forwards[1]
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

    from pixart_lowvram.nodes.batched_guidance import PixArtBatchedGuidance
    from pixart_lowvram.nodes.int8_model import repeatable

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
    from pixart_lowvram.nodes.int8_model import repeatable

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

    from pixart_lowvram.nodes.int8_model import repeatable

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


# ---- the MODEL's runs: its LoRAs folded once a run, and leaving the GPU between prompts ---------------


@pytest.fixture(scope="module")
def lora_model(comfy, pack_model, tiny_folder, tmp_path_factory):
    """The pack's MODEL with a random LoRA on every attention and feed-forward layer, through ComfyUI's own
    LoRA loading (what LoraLoaderModelOnly runs), at strength 0.8."""
    import comfy.sd
    import comfy.utils

    from pixart_lowvram.cli.random_model import save_random_lora

    path = save_random_lora(
        tiny_folder, tmp_path_factory.mktemp("lora") / "lora.safetensors", rank=4, scale=0.05
    )
    state = comfy.utils.load_torch_file(str(path), safe_load=True)
    return comfy.sd.load_lora_for_models(pack_model, None, state, 0.8, 0)[0]


def run_of(model):
    """The MODEL's run (its ON_PRE_RUN callback's object), which every clone shares."""
    from pixart_lowvram.nodes import int8_model

    return next(
        callback.__self__
        for callback in model.get_all_callbacks("on_pre_run")
        if isinstance(getattr(callback, "__self__", None), int8_model.lora.RunPatches)
    )


def test_plain_loras_fold_into_the_weights_as_comfyui_sums_them(comfy, lora_model):
    """Each layer's LoRA patches, read once for the set of patches, folded into its expanded weight: what
    ComfyUI's own calculate_weight makes of the same patches, within fp32 rounding; the fused q, k, v
    layer takes each LoRA at its rows."""
    import comfy.lora

    from pixart_lowvram.nodes import int8_model

    run = run_of(lora_model)
    factors = run.factors(lora_model)
    layers = dict(run.layers(lora_model))
    assert factors and all(branches is not None for branches in factors.values())
    assert any(branch.rows is not None for branches in factors.values() for branch in branches)
    for key, branches in factors.items():
        weight = layers[key].expanded()
        folded = int8_model.lora._Fold(branches)(weight.clone())
        summed = comfy.lora.calculate_weight(lora_model.patches[key], weight.clone(), key)
        torch.testing.assert_close(folded, summed, rtol=1e-5, atol=1e-6, msg=key)
    assert run.factors(lora_model) is factors  # the same set of patches: not read again
    assert run.factors(lora_model.clone()) is factors  # a clone holds the same patches
    run.read = None


def test_a_runs_lora_factors_are_one_block_copied_once(comfy, lora_model):
    """The factors of a set of patches lie in one block of CPU memory, and a run's copy of them
    is one block on the device (the meta device stands for the GPU here) holding every factor at its place:
    the same shapes, and on the CPU the same values without a copy."""
    run = run_of(lora_model)
    factors = run.factors(lora_model)
    tensors = [t for branches in factors.values() for b in branches for t in (b.up, b.down)]
    block = factors.block.memory
    assert len(tensors) > 2 and block.numel() >= sum(t.numel() * t.element_size() for t in tensors)
    assert all(t.untyped_storage().data_ptr() == block.untyped_storage().data_ptr() for t in tensors)

    there = factors.on(torch.device("meta"))
    moved = [t for branches in there.values() for b in branches for t in (b.up, b.down)]
    assert [t.shape for t in moved] == [t.shape for t in tensors]
    assert all(t.is_meta and t.untyped_storage().nbytes() == block.untyped_storage().nbytes() for t in moved)

    here = factors.on(torch.device("cpu"))
    kept = [t for branches in here.values() for b in branches for t in (b.up, b.down)]
    assert all(t.data_ptr() == s.data_ptr() and torch.equal(t, s) for t, s in zip(kept, tensors, strict=True))
    assert [b.scale for bs in here.values() for b in bs] == [b.scale for bs in factors.values() for b in bs]
    run.read = None


def test_a_run_with_the_fold_samples_what_comfyuis_sum_samples(comfy, pack_model, lora_model, monkeypatch):
    """The whole run: LoRAs folded by the pack, against the same patches summed by ComfyUI's own
    calculate_weight (every patch taken as one the fold does not know); the LoRA changes the latents."""
    from pixart_lowvram.nodes import int8_model

    run = run_of(lora_model)
    run.read = None
    folded, _ = sample(comfy, lora_model)
    monkeypatch.setattr(int8_model.lora, "_plain_loras", lambda patches, dtype: None)
    run.read = None
    summed, _ = sample(comfy, lora_model)
    run.read = None
    without, _ = sample(comfy, pack_model)
    assert cosine(folded, summed) >= GUIDANCE_COSINE[torch.float32]
    assert (folded - without).abs().max() > 100 * (folded - summed).abs().max()


def test_a_graphed_run_of_the_model_gives_its_bits_and_drops_its_graphs(comfy, lora_model, monkeypatch):
    """A run with its forward graphed (PIXART_LOWVRAM_CUDA_GRAPH=1 on a GPU; here the stand-in capture,
    tests/graph_stand_in.py) with a LoRA in the weights: one capture at the second step, replays after, the
    same latents as the run without (the same computation on the same inputs); the run's end drops the
    graphs, and the next run captures its own."""
    from graph_stand_in import StandIn

    from pixart_lowvram.core import step_graph
    from pixart_lowvram.nodes.int8_model import forward

    plain, _ = sample(comfy, lora_model)
    capture = StandIn()
    monkeypatch.setattr(step_graph, "cuda_capture", capture)
    monkeypatch.setattr(step_graph, "wanted", lambda *args: True)
    graphed, batches = sample(comfy, lora_model)
    assert (capture.captures, capture.replays) == (1, len(batches) - 1) == (1, STEPS - 1)
    assert torch.equal(graphed, plain)
    assert lora_model.object_patches[forward.OBJECT].graphs is None
    again, _ = sample(comfy, lora_model)
    assert capture.captures == 2 and torch.equal(again, plain)


def test_a_patch_that_is_not_a_plain_lora_goes_through_comfyuis_sum(comfy, pack_model):
    """A patch of another kind (here a weight difference) on a layer: that layer's run takes ComfyUI's own
    calculate_weight; the run's end takes every patch off."""
    from pixart_lowvram.core.quant import quanto
    from pixart_lowvram.nodes import int8_model

    model = pack_model.clone()
    key = "diffusion_model.blocks.0.mlp.fc1.weight"
    run = run_of(model)
    layer = dict(run.layers(model))[key]
    stored = quanto.expand(layer.weight, layer.weight_scale)
    model.add_patches({key: (torch.full_like(stored, 0.01),)}, 1.0)
    run.start(model)
    try:
        assert isinstance(layer.weight_patch, int8_model.lora._Patches)
        torch.testing.assert_close(layer.expanded(), stored + 0.01)
    finally:
        run.end(model)
        run.read = None
    assert layer.weight_patch is None
    torch.testing.assert_close(layer.expanded(), stored, rtol=0, atol=0)


@pytest.mark.parametrize("compute", ["int8", "fp8"])
def test_a_lora_in_the_8bit_weights_moves_the_latents_as_on_fp16(
    comfy, tiny_folder, tmp_path_factory, compute
):
    """The MODEL computing in 8 bits with a LoRA through ComfyUI's own loading (every attention and
    feed-forward layer, the fused q, k, v layer's three at their rows): the LoRA moves KSampler's latents as
    it moves them on the fp16 MODEL (cosine of the two changes: measured 0.999 int8, 0.979 fp8). The LoRA
    is a strong one (its change a fifth of the latents, over ten times the 8-bit error): a weak one's change
    on the tiny random model is of the size of fp8's own error, which the comparison would then measure."""
    import comfy.sd
    import comfy.utils

    from pixart_lowvram.cli.random_model import save_random_lora

    path = save_random_lora(
        tiny_folder, tmp_path_factory.mktemp("lora") / "lora.safetensors", rank=4, scale=0.2
    )
    state = comfy.utils.load_torch_file(str(path), safe_load=True)
    changes = {}
    for route in ("fp16", compute):
        model = int8_model_of(tiny_folder, tmp_path_factory, compute=route)
        with_lora = comfy.sd.load_lora_for_models(model, None, state, 1.0, 0)[0]
        without, _ = sample(comfy, model)
        changes[route] = (sample(comfy, with_lora)[0] - without, without)
    moved, fp16_moved = changes[compute][0], changes["fp16"][0]
    assert cosine(moved, fp16_moved) >= 0.95
    assert moved.norm() > 10 * (changes[compute][1] - changes["fp16"][1]).norm()


@pytest.fixture(scope="module")
def kept_model(comfy, tiny_folder, tmp_path_factory):
    """The pack's MODEL loaded with keep_loaded on."""
    return int8_model_of(tiny_folder, tmp_path_factory, keep_loaded=True)


def loaded(model) -> bool:
    """Whether ComfyUI holds the MODEL (any clone of it) among its loaded models."""
    import comfy.model_management

    return any(
        getattr(entry.model, "model", None) is model.model
        for entry in comfy.model_management.current_loaded_models
    )


def test_keep_loaded_off_lets_comfyui_unload_the_model_after_each_run(comfy, pack_model, kept_model):
    """keep_loaded off (the loader's default): when a run ends, ComfyUI unloads the MODEL as it unloads its
    own models for room — also after a run that fails — and only it; on, ComfyUI keeps it loaded as it keeps
    its own models."""
    import comfy.model_management

    sample(comfy, kept_model)
    assert loaded(kept_model)
    sample(comfy, pack_model)
    assert not loaded(pack_model) and loaded(kept_model)

    seen = []

    def stop(apply_model, args):
        seen.append(loaded(pack_model))
        raise comfy.model_management.InterruptProcessingException()

    failing = pack_model.clone()
    failing.set_model_unet_function_wrapper(stop)
    latent = torch.zeros(1, 4, SIZE // 8, SIZE // 8)
    noise = comfy.sample.prepare_noise(latent, 5)
    positive, negative = conditioning(failing, PROMPT_TOKENS, 1), conditioning(failing, 1, 2)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        comfy.sample.sample(failing, noise, STEPS, CFG, "euler", "normal", positive, negative, latent, seed=5)
    assert seen == [True]  # loaded for its run
    assert not loaded(pack_model) and loaded(kept_model)


def test_the_models_layers_go_back_to_their_host_copies_in_cpu_memory(comfy, pack_model):
    """A layer of the MODEL moved off the CPU keeps its tensors' host copies; moved back, the host copies are
    in place (the same memory and values: nothing copied back) and nothing on the device is held. The meta
    device stands for the GPU here: a meta tensor has no data, so the move back makes fresh CPU tensors for
    whatever has no host copy."""
    import copy

    layer = copy.deepcopy(pack_model.model.diffusion_model.blocks[0].mlp.fc1)
    names = ("weight", "weight_scale", "bias")
    before = {name: getattr(layer, name).data_ptr() for name in names}
    values = {name: getattr(layer, name).clone() for name in names}
    layer.to(torch.device("meta"))
    assert all(getattr(layer, name).device.type == "meta" for name in names)
    layer._apply(lambda t: torch.empty_like(t, device="cpu") if t.is_meta else t.to("cpu"))
    assert {name: getattr(layer, name).data_ptr() for name in names} == before
    assert all(torch.equal(getattr(layer, name), values[name]) for name in names)
    assert layer._host_copies["weight"][1]() is None and layer._host_copies["weight_scale"][1]() is None


def test_a_walk_asks_where_it_puts_each_kind_of_tensor_once(comfy, pack_model):
    """Moving the whole MODEL (its transformer here, to the meta device standing for the GPU, and back),
    each of the layers' ``_apply`` asks the walk's function where it puts a tensor of each kind (dtype and
    device) once a walk, not once a tensor: the question is a zero-size tensor made and moved. A new walk
    asks again, and the layers end in their host copies as before."""
    import copy

    pixart = copy.deepcopy(pack_model.model.diffusion_model)
    layers = [m for m in pixart.modules() if hasattr(m, "COPIED")]
    kinds = {
        (tensor.dtype, tensor.device)
        for layer in layers
        for kind, name in layer.COPIED
        if (tensor := getattr(layer, kind).get(name)) is not None
    }
    before = {id(layer): layer.weight.data_ptr() for layer in layers}
    asked = []

    def walk(to):
        def fn(t):
            if t.numel() == 0:
                asked.append((t.dtype, t.device))
            return torch.empty_like(t, device="cpu") if t.is_meta and to == "cpu" else t.to(to)

        pixart._apply(fn)
        return len(asked)

    there = walk("meta")
    assert len(layers) > 10 and there == len(kinds) < 3 * len(layers)
    asked.clear()
    assert walk("cpu") == len(kinds)  # the meta tensors' kinds: asked anew, once each
    assert {id(layer): layer.weight.data_ptr() for layer in layers} == before


def test_the_pack_forward_computes_what_comfyuis_pixart_computes(comfy, pack_model):
    """The MODEL's forward (its object patch of ComfyUI's forward_orig: diffusers' blocks over the MODEL's
    own layers) against ComfyUI's own forward_orig on the same inputs, square and not: within fp32 rounding."""
    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    pixart = pack_model.model.diffusion_model
    forward = pack_model.object_patches[pack_forward.OBJECT]
    generator = torch.Generator().manual_seed(0)
    for height, width in ((34, 34), (40, 28), (64, 36)):
        x = torch.randn(2, 4, height, width, generator=generator)
        timestep = torch.tensor([999.0, 421.0])
        y = torch.randn(2, 1, 12, caption_width(pack_model), generator=generator)
        with torch.inference_mode():
            ours = forward(x, timestep, y)
            theirs = type(pixart).forward_orig(pixart, x, timestep, y)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=f"{height}×{width}")
    forward.reset()


def test_comfyuis_attention_module_in_the_blocks_changes_nothing(comfy, tiny_folder, tmp_path_factory):
    """ComfyUI 0.38's PixArt attention layers each hold a ``ComfyAttention`` module (the attention a
    checkpoint's per-layer setting picks; no weights), simulated here on every attention layer of a fresh
    MODEL: the pack's forward built over those layers computes what it computed without them, and the walks
    over the MODEL's layers (its LoRA layers, its quantized linears) find the same ones."""
    from pixart_lowvram.core.quant import quanto
    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    class ComfyAttention(torch.nn.Module):  # 0.38's, in comfy/ldm/modules/attention.py: its state only
        def __init__(self):
            super().__init__()
            self.config = self.function = None

    model = int8_model_of(tiny_folder, tmp_path_factory)
    pixart = model.model.diffusion_model
    forward = model.object_patches[pack_forward.OBJECT]
    generator = torch.Generator().manual_seed(3)
    x, timestep = torch.randn(2, 4, 34, 34, generator=generator), torch.tensor([999.0, 421.0])
    y = torch.randn(2, 1, 12, caption_width(model), generator=generator)
    with torch.inference_mode():
        before = forward(x, timestep, y)
    forward.reset()
    linears = quanto.linear_layers(pixart)
    for block in pixart.blocks:
        block.attn.comfy_attention, block.cross_attn.comfy_attention = ComfyAttention(), ComfyAttention()
    rebuilt = pack_forward.PackForward(pixart, forward.config, forward.unet_config)
    with torch.inference_mode():
        after = rebuilt(x, timestep, y)
    rebuilt.reset()
    assert torch.equal(after, before)
    assert quanto.linear_layers(pixart) == linears
    assert sum(isinstance(m, ComfyAttention) for m in pixart.modules()) == 2 * len(pixart.blocks)


def test_the_position_embedding_is_made_once_a_run_as_diffusers_makes_it(comfy, pack_model, monkeypatch):
    """The MODEL's forward makes its position embedding once for a size and device (diffusers' PatchEmbed
    would make it at every step), the same bits as made at every call, and holds none after the run."""
    import diffusers.models.embeddings as embeddings

    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    forward = pack_model.object_patches[pack_forward.OBJECT]
    made = []
    original = embeddings.get_2d_sincos_pos_embed
    monkeypatch.setattr(
        embeddings, "get_2d_sincos_pos_embed", lambda *a, **k: made.append(a[1]) or original(*a, **k)
    )
    sample(comfy, pack_model)
    assert made == [(17, 17)]  # 34×34 latents, patch 2: one embedding for the whole run
    assert forward.placed is None and forward.skeleton.pos_embed.pos_embed.shape == (
        1,
        1,
        forward.embed_width,
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 40, 28, generator=generator)
    timestep, y = (
        torch.tensor([999.0, 421.0]),
        torch.randn(2, 1, 12, caption_width(pack_model), generator=generator),
    )
    with torch.inference_mode():
        kept = [forward(x, timestep, y) for _ in range(2)]
        anew = []
        for _ in range(2):
            forward.unplace()
            anew.append(forward(x, timestep, y))
    forward.reset()
    assert made[1:] == [(20, 14)] * 3  # the kept one made once, then once a call
    assert all(torch.equal(a, b) for a, b in zip(kept, anew, strict=True))


def test_no_attention_call_asks_for_its_processors_signature(comfy, pack_model, monkeypatch):
    """diffusers' Attention asks for its processor's signature at every call; the MODEL's processors have
    theirs made once, so a KSampler run computes none."""
    import inspect

    from pixart_lowvram.core import attention
    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    forward = pack_model.object_patches[pack_forward.OBJECT]
    processors = {
        type(module.processor) for module in forward.skeleton.modules() if hasattr(module, "processor")
    }
    assert processors == {attention.Processor}
    computed = []
    original = inspect._signature_from_function
    monkeypatch.setattr(
        inspect, "_signature_from_function", lambda *a, **k: computed.append(a[1]) or original(*a, **k)
    )
    sample(comfy, pack_model)
    assert not [function for function in computed if "Processor" in function.__qualname__]


def test_ksampler_runs_diffusers_blocks_on_the_models_layers(comfy, pack_model):
    """Under KSampler the MODEL's steps run diffusers' blocks (each step's one batched forward), none of
    ComfyUI's; ComfyUI's own forward, the object patch taken off, samples the same latents within the
    guidance bound."""
    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    forward = pack_model.object_patches[pack_forward.OBJECT]
    calls = {"diffusers": 0, "comfyui": 0}
    hooks = [
        forward.skeleton.transformer_blocks[0].register_forward_hook(
            lambda *_: calls.__setitem__("diffusers", calls["diffusers"] + 1)
        ),
        pack_model.model.diffusion_model.blocks[0].register_forward_hook(
            lambda *_: calls.__setitem__("comfyui", calls["comfyui"] + 1)
        ),
    ]
    try:
        latents, batches = sample(comfy, pack_model)
        assert calls == {"diffusers": STEPS, "comfyui": 0} and batches == [2] * STEPS
        comfyuis = pack_model.clone()
        comfyuis.object_patches.pop(pack_forward.OBJECT)
        reference, _ = sample(comfy, comfyuis)
        assert calls["comfyui"] == STEPS
    finally:
        for hook in hooks:
            hook.remove()
    assert cosine(latents, reference) >= GUIDANCE_COSINE[torch.float32]
    # Released after its run (keep_loaded off): ComfyUI has taken its object patches off again.
    assert not loaded(pack_model)
    assert not isinstance(pack_model.model.diffusion_model.forward_orig, pack_forward.PackForward)


def test_ksamplers_attention_on_the_model_runs_through_the_choice(comfy, pack_model, monkeypatch):
    """Each attention call of the MODEL's forward under KSampler goes through core.attention's chosen
    backend, as self or cross: the cross-attention over the prompt's own tokens, without a mask (its new
    key lengths count in the choice). The latents are the same bits (on the CPU nothing is chosen)."""
    from pixart_lowvram.core import attention

    latents, _ = sample(comfy, pack_model)
    seen = []
    attend = attention.attend

    def recording(kind, q, k, v, mask=None):
        seen.append((kind, mask is not None))
        return attend(kind, q, k, v, mask)

    monkeypatch.setattr(attention, "attend", recording)
    again, _ = sample(comfy, pack_model)
    assert set(seen) == {("self", False), ("cross", False)}
    assert sum(kind == "self" for kind, *_ in seen) == sum(kind == "cross" for kind, *_ in seen)
    assert torch.equal(again, latents)


def test_the_8bit_models_forward_quantizes_each_input_with_the_op_before_it(
    comfy, tiny_folder, tmp_path_factory, monkeypatch, fused_op_calls
):
    """compute int8 on the MODEL: its forward's blocks are the sampler's fused ones, each 8-bit layer's
    input quantized by one fused op (counted), within the unfused blocks' own 8-bit error ``e`` of compute
    fp16's forward (``e`` measured here) and within 2e of the unfused forward (float32 here, where the fused
    references may round as the unfused ops do: 0 allowed), with ``PIXART_LOWVRAM_FUSED_QUANT=1``; ``0``
    gives the unfused blocks."""
    from pixart_lowvram.core.quant import block as fused_block
    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    calls = fused_op_calls
    generator = torch.Generator().manual_seed(5)
    x, timestep = torch.randn(2, 4, 34, 34, generator=generator), torch.tensor([999.0, 421.0])
    y = None

    def forward_of(compute: str) -> tuple[torch.Tensor, list]:
        nonlocal y
        model = int8_model_of(tiny_folder, tmp_path_factory, compute=compute)
        forward = model.object_patches[pack_forward.OBJECT]
        if y is None:
            y = torch.randn(2, 1, 40, caption_width(model), generator=generator)
        calls.clear()
        with torch.inference_mode():
            out = forward(x, timestep, y)
        forward.reset()
        return out, [vars(block).get("forward") for block in forward.skeleton.transformer_blocks]

    monkeypatch.setenv(fused_block.VARIABLE, "1")
    full, plain = forward_of("fp16")
    assert calls == {}
    fused, switched = forward_of("int8")
    blocks = len(switched)
    # q/k/v and ff1 from the norm + modulation, ff2 from the GELU, the output projections and the
    # cross-attention's query from a plain quantization (the caption's 80 rows quantize in their layers).
    assert calls == {
        "norm_modulate_quantize": 2 * blocks,
        "gelu_quantize": blocks,
        "quantize_rows": 3 * blocks,
    }
    monkeypatch.setenv(fused_block.VARIABLE, "0")
    unfused, unswitched = forward_of("int8")
    assert calls == {}
    assert plain == unswitched == [None] * blocks
    assert [method.__func__ for method in switched] == [fused_block.fused_forward] * blocks

    error = relative_error(unfused, full)
    assert 0 < error < 0.05, error
    assert relative_error(fused, unfused) <= 2 * error
    assert relative_error(fused, full) <= 1.1 * error


def test_the_compiled_models_captions_of_every_length_run_one_graph(
    comfy, tiny_folder, tmp_path_factory, graphs
):
    """ComfyUI's caption is as long as its prompt: the compiled MODEL's blocks trace one graph for every
    length (the caption's length dynamic from the first call, the first block's input row-major as the
    others'), so a prompt never waits for a compile after the first, nor runs another graph than before."""
    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    model = int8_model_of(tiny_folder, tmp_path_factory, compute="int8")
    eager = model.object_patches[pack_forward.OBJECT]
    compiled = pack_forward.PackForward(
        model.model.diffusion_model, eager.config, eager.unet_config, "int8", compiled=True
    )
    x, timestep = torch.randn(2, 4, 34, 34), torch.tensor([999.0, 421.0])
    try:
        for tokens in (40, 52, 23):  # each over MIN_ROWS rows: the 8-bit path for the caption's projections
            with torch.inference_mode():
                compiled(x, timestep, torch.randn(2, 1, tokens, caption_width(model)))
        assert len(graphs) == 1
    finally:
        compiled.reset()


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "unfused"])
def test_the_8bit_models_compiled_forward_computes_what_its_eager_one_does(
    comfy, tiny_folder, tmp_path_factory, monkeypatch, fused
):
    """The MODEL's forward with its blocks compiled (as on a GPU: dynamic shapes, ComfyUI's caption as long
    as its prompt), fused or not, against the same forward eager, for two caption lengths: the same
    arithmetic, so within float32 rounding and the odd 8-bit rounding step it moves."""
    from pixart_lowvram.core.quant import block as fused_block
    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    monkeypatch.setenv(fused_block.VARIABLE, fused)
    model = int8_model_of(tiny_folder, tmp_path_factory, compute="int8")
    eager = model.object_patches[pack_forward.OBJECT]
    assert eager.fused == (fused == "1")
    compiled = pack_forward.PackForward(
        model.model.diffusion_model, eager.config, eager.unet_config, "int8", compiled=True, fused=eager.fused
    )
    generator = torch.Generator().manual_seed(9)
    x, timestep = torch.randn(2, 4, 34, 34, generator=generator), torch.tensor([999.0, 421.0])
    captions = {
        tokens: torch.randn(2, 1, tokens, caption_width(model), generator=generator) for tokens in (40, 52)
    }
    outputs = []
    for tokens in (40, 52, 40):
        with torch.inference_mode():
            expected, got = eager(x, timestep, captions[tokens]), compiled(x, timestep, captions[tokens])
        difference = relative_error(got, expected)
        assert difference < 1e-3, f"{tokens} tokens: {difference}"
        outputs.append(got)
    assert torch.equal(outputs[2], outputs[0])  # a caption's output whatever length ran before it
    assert all(
        vars(block)["forward"].__class__.__name__ != "method"
        for block in compiled.skeleton.transformer_blocks
    )  # compiled wrappers around the fused forward
    eager.reset(), compiled.reset()


def test_a_lora_on_the_compiled_8bit_model_compiles_once_for_every_run(
    comfy, tiny_folder, tmp_path_factory, graphs, monkeypatch
):
    """Each sampling run gives the 8-bit layers new LoRAs (new tensors copied to the device, another strength)
    and holds their patched weights quantized again: the compiled, fused MODEL traces its blocks once with
    held weights and runs that graph on every later run (no graph break, no compile per prompt or strength).
    (tests/test_fused_block.py: a LoRA keeps every input fused.)"""
    from pixart_lowvram.core.quant import block as fused_block
    from pixart_lowvram.core.quant import compute as compute_paths
    from pixart_lowvram.core.quant import quanto
    from pixart_lowvram.nodes import int8_model
    from pixart_lowvram.nodes.int8_model import forward as pack_forward

    monkeypatch.setenv(fused_block.VARIABLE, "1")
    model = int8_model_of(tiny_folder, tmp_path_factory, compute="int8")
    eager = model.object_patches[pack_forward.OBJECT]
    compiled = pack_forward.PackForward(
        model.model.diffusion_model, eager.config, eager.unet_config, "int8", compiled=True, fused=True
    )
    blocks = model.model.diffusion_model.blocks
    layers = [layer for layer in blocks.modules() if isinstance(layer, quanto.ScaledWeightLinear)]
    x, timestep = torch.randn(2, 4, 34, 34), torch.tensor([999.0, 421.0])
    caption = torch.randn(2, 1, 40, caption_width(model))
    rank = 4
    try:
        for run, strength in enumerate((1.0, 0.5, 2.0)):
            # What RunPatches.start gives each 8-bit layer: fresh factors each run, views of one block copied
            # to the device (nodes/int8_model/lora.py, _Factors), folded into the weight, which the run holds.
            generator = torch.Generator().manual_seed(run)
            read = {
                str(index): (
                    compute_paths.LowRank(
                        torch.randn(layer.out_features, rank, generator=generator).to(
                            layer.weight_scale.dtype
                        ),
                        torch.randn(rank, layer.in_features, generator=generator).to(
                            layer.weight_scale.dtype
                        ),
                        strength,
                    ),
                )
                for index, layer in enumerate(layers)
            }
            there = int8_model.lora._Factors(read).on(torch.device("cpu"))
            for index, layer in enumerate(layers):
                layer.weight_patch = int8_model.lora._Fold(there[str(index)])
            assert quanto.hold_dense(blocks) == len(layers)
            with torch.inference_mode():
                compiled(x, timestep, caption)
            assert len(graphs) == 1, f"run {run}: {len(graphs)} graphs"
            quanto.drop_dense(blocks)
            for layer in layers:
                quanto.clear_run_patches(layer)
    finally:
        for layer in layers:
            quanto.clear_run_patches(layer)
        compiled.reset()
