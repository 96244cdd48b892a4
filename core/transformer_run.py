"""The quantized transformer made ready for a run: placed on its device, whole or with its blocks streamed
from CPU memory (:mod:`.streaming`), its attention the pack's (:mod:`.attention`), its blocks compiled for
``fast``; and what a run wraps it in, the weights held expanded and diffusers' First Block Cache. The
sampler (:mod:`.sampler`) runs it; the int8 MODEL's forward (``nodes/int8_model/forward.py``) compiles
its own blocks with :func:`compile_blocks` and :func:`settle_attention` too."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch

from . import attention, estimates, measure, streaming
from .estimates import Workload
from .quant import Scheme, quanto
from .quant import compute as compute_paths
from .sampler_settings import SamplerSettings
from .transformer import quantized_transformer

logger = logging.getLogger(__name__)


def _load(settings: SamplerSettings, streamed: bool):
    """The transformer, quantized (:func:`.transformer.quantized_transformer`), on the settings' device; ``streamed``:
    kept in CPU memory and its blocks streamed to the device one at a time (:mod:`streaming`). ``fast``:
    the blocks are compiled."""
    return prepare(
        quantized_transformer(settings.transformer),
        settings.scheme,
        settings.device,
        streamed,
        settings.compiled,
        quantized=True,
        compute=settings.transformer.compute,
    )


def prepare(
    model,
    scheme: Scheme,
    device: torch.device,
    low_vram: bool = False,
    fast: bool = False,
    quantized: bool = False,
    compute: str = compute_paths.FP16,
):
    """A loaded transformer (on the CPU) quantized — unless ``quantized`` says it is already — and made
    ready to run on ``device`` (see ``_load``); ``low_vram``: its blocks streamed; ``fast``: its blocks
    compiled; ``compute``: how its blocks' quantized layers compute (:mod:`.quant.compute`)."""
    if not quantized:
        model = scheme.after_load(model)
    # No gradients: the same parameter types on every run, whether the weights were moved whole or copied
    # back from host memory (the compiled fast path would compile again for another requires_grad).
    model.eval().requires_grad_(False)
    blocks = model.transformer_blocks
    attention.install(model)
    scheme.plain_modules(model)
    quanto.set_compute(blocks, compute)
    if compute != compute_paths.FP16:  # an 8-bit compute: only then import Triton, where it is installed
        from .quant import block

        if block.fused(compute, device):
            block.use_fused(blocks, compute)
    if low_vram:
        streaming.stream_blocks(model, blocks, device)
    else:
        streaming.move_model(model, device)
    if fast:
        compile_blocks(blocks)
    return model


@contextlib.contextmanager
def _dense(settings: SamplerSettings, transformer, work: Workload) -> Iterator[None]:
    """The run with the weights the quantized layers compute with held (expanded, or an 8-bit layer's
    patched weight quantized again: :attr:`.sampler_settings.SamplerSettings.dense`) when the device has room
    for them beside the run itself; otherwise each layer makes its weight as it runs (the same numbers, more
    kernel launches)."""
    held = settings.scheme.dense_bytes(transformer) if settings.dense else 0
    if not held:
        yield
        return
    # The run's own work: the stage's estimate (device_bytes) counts the expanded copy in already.
    _weights, run = estimates.transformer(settings.scheme, settings.dtype, work.images, work.pixels)
    needed = held + run
    room = measure.device_room(settings.device)
    if needed > room:
        logger.info(
            "sampler: %s free on %s, %s needed to hold the weights expanded; expanding them per layer",
            measure.format_bytes(room),
            settings.device,
            measure.format_bytes(needed),
        )
        yield
        return
    with settings.scheme.dense_weights(transformer):
        yield


@contextlib.contextmanager
def _step_cache(transformer, threshold: float, steps: int) -> Iterator[None]:
    """The run with diffusers' First Block Cache on the transformer's blocks (``threshold`` > 0): each step
    runs the first block, and where its output's change since the last full step, relative to that step's,
    is below ``threshold`` the other blocks return at once and their last change is added instead. The
    hooks come off after the run: the kept and pooled transformer stays the one without them. Logs on how
    many steps the blocks after the first ran."""
    if threshold <= 0:
        yield
        return
    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
    from diffusers.models.cache_utils import CacheMixin

    # The last block's attention runs only on steps where the blocks after the first run.
    full = [0]
    counter = transformer.transformer_blocks[-1].attn1.register_forward_hook(
        lambda *_: full.__setitem__(0, full[0] + 1)
    )
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    # Newer diffusers cache each registry's children: refreshed so the context reaches the new block hooks.
    refresh = getattr(registry, "invalidate_child_registries_cache", lambda: None)
    refresh()
    try:
        # diffusers' cache hooks keep their state per named context, which its own pipelines set with
        # CacheMixin.cache_context (a mixin PixArt's transformer class lacks; the method uses only the module).
        with CacheMixin.cache_context(transformer, "cfg"):
            yield
    finally:
        registry.remove_hook(_FBC_LEADER_BLOCK_HOOK, recurse=True)
        registry.remove_hook(_FBC_BLOCK_HOOK, recurse=True)
        refresh()
        counter.remove()
    logger.info(
        "sampler: step_cache %g ran every block on %d of %d steps, only the first on the others",
        threshold,
        full[0],
        steps,
    )


def settle_attention(config, device, dtype, batch: int, height: int, width: int, keys: int, masked: bool):
    """The attention choices for a compiled run of a transformer of ``config`` (:func:`.attention.settle`),
    made before its blocks are traced, at its shapes: ``batch`` items of ``height`` × ``width`` latents
    (their patches the queries) and ``keys`` caption tokens, ``masked`` or not."""
    attention.settle(
        device,
        dtype,
        batch=batch,
        heads=config.num_attention_heads,
        head_dim=config.attention_head_dim,
        queries=(height // config.patch_size) * (width // config.patch_size),
        keys=keys,
        masked=masked,
    )


COMPILE_BACKEND = "inductor"
FAST_FIX = (
    "Turn the sampler's fast option off and set compute to fp16 (the blocks then run uncompiled; fast alone "
    "gives the same image uncompiled)."
)


def compile_blocks(blocks: torch.nn.ModuleList, captions_vary: bool = False) -> None:
    """``torch.compile`` each block's forward (the hooks around it stay eager). The blocks share their
    code and the first takes its input as the others do (:func:`_as_blocks_take`), so all 28 run on one
    compiled graph; a new image size compiles once more. ``captions_vary``: the caption's length is dynamic
    from the first compile (ComfyUI's conditioning is as long as its prompt), so every length runs that one
    graph, and a prompt gives the same image whatever ran before it; otherwise (the sampler's caption, padded
    to a fixed length) every shape is static."""
    try:
        for block in blocks:
            block.forward = torch.compile(
                block.forward, backend=COMPILE_BACKEND, dynamic=None if captions_vary else False
            )
    except Exception as exc:  # the compiler's own imports (a torch build without a working inductor)
        raise compile_failed(exc) from exc
    blocks[0].register_forward_pre_hook(functools.partial(_as_blocks_take, captions_vary), with_kwargs=True)


def _as_blocks_take(captions_vary: bool, _block, args: tuple, kwargs: dict):
    """The first block's pre-hook: its hidden states row-major, as every other block takes them (the patch
    embedding's come transposed: a graph of their own, where inductor laid the 8-bit activations of the
    first block out column-major, which ``torch._int_mm`` refuses on CUDA unless the rows are a multiple of
    4), and with ``captions_vary`` the caption's length marked dynamic."""
    if captions_vary and kwargs.get("encoder_hidden_states") is not None:
        torch._dynamo.maybe_mark_dynamic(kwargs["encoder_hidden_states"], 1)
    hidden = args[0]
    if hidden.is_contiguous():
        return None
    return (hidden.contiguous(), *args[1:]), kwargs


class CompileFailed(RuntimeError):
    """torch.compile cannot run on this machine (:func:`compile_failed`); ``cause``: the compiler's own
    error, in one line."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def compile_failed(exc: BaseException) -> CompileFailed:
    """The error for a torch.compile that cannot run here, at wrapping or at the first call
    (``BackendCompilerFailed``, whose ``inner_exception`` is the compiler's own)."""
    cause = getattr(exc, "inner_exception", None) or exc
    said = f"{type(cause).__name__}: {cause}"
    return CompileFailed(f"fast: torch.compile failed on this machine ({said}). {FAST_FIX}", said)
