"""What makes KSampler give a PixArt-Σ MODEL's image again for the same prompt and seed, the first prompt
after a load and the first of a process included: the noise schedule computed on the CPU wherever the
model lies, and the attention kernel chosen before the first step.

**The schedule.** KSampler computes its sigmas (``comfy.samplers.calculate_sigmas``: ``model_sampling.sigma`` and
``timestep`` over ``log_sigmas``) before it loads the model. ComfyUI's ``ModelSamplingDiscrete`` keeps
``sigmas`` and ``log_sigmas`` as buffers of the model (``set_sigmas``: ``register_buffer``, the same in
v0.3.64, v0.8.0 and v0.33.0), which move with it: in the first prompt after a load they are on the CPU, in
every later one on the GPU, and the GPU's ``log``/``exp`` round differently from the CPU's (H200,
2026-12-02: 5 of 21 sigmas of a 20-step ``normal`` schedule differed, by up to 4.8e-7), so the first
prompt's image differed from a repeat of it. ComfyUI's ``sigma`` and ``timestep`` already move their input
to the tables' device and the result back; :func:`apply` gives the MODEL, as an object patch (``ModelPatcher.
add_object_patch``, what ComfyUI's ModelSampling nodes use), a copy of its ``model_sampling`` whose tables
are plain attributes on the CPU, which ``Module.to`` leaves where they are.

**The attention kernel.** The first attention call of a process took another kernel than every later one (H200,
torch 2.11: see :func:`settle_attention`), so the first prompt of a server differed from its repeats.

:func:`apply` sets both on a ModelPatcher; the pack's int8 MODEL has them from its loader, the Batched
Guidance node sets them on any PixArt-Σ MODEL."""

from __future__ import annotations

import copy
import functools

import comfy.model_sampling
import comfy.ops
import torch
from comfy.patcher_extension import CallbacksMP

NAME = "model_sampling"
CALLBACK_KEY = "pixart_lowvram_repeatable"


TABLES = ("sigmas", "log_sigmas")


class _CpuTables:
    """Keeps ``sigmas`` and ``log_sigmas`` as plain CPU tensors, not buffers, whoever registers them:
    ComfyUI's ``set_sigmas``, or Dynamic VRAM (v0.33) restoring the buffers it backed up at a load under
    their names (``comfy.utils.set_attr_buffer``, which reaches this copy through the object patch)."""

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        if name not in TABLES or tensor is None:
            return super().register_buffer(name, tensor, persistent)
        self._buffers.pop(name, None)
        self.__dict__[name] = tensor.detach().cpu()


@functools.cache
def _cpu_class(base: type) -> type:
    return type(f"{base.__name__}OnCpu", (_CpuTables, base), {})


def cpu_schedule(model_sampling: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model_sampling`` (a ``ModelSamplingDiscrete``) whose tables stay on the CPU; the values
    are the CPU's, as ComfyUI computes them when it builds the model."""
    stable = copy.deepcopy(model_sampling)
    stable.__class__ = _cpu_class(type(model_sampling))
    for name in TABLES:
        stable.register_buffer(name, stable._buffers[name])
    return stable


# Devices whose attention kernel choice :func:`settle_attention` has made in this process.
_settled: set[str] = set()
# ComfyUI v0.33 leaves calls under 1024 × 128 query elements to torch's own order.
WARM_UP_SHAPE = (1, 16, 128, 72)


def settle_attention(patcher) -> None:
    """``ON_PRE_RUN`` callback: one attention call through ComfyUI's own function on the MODEL's device,
    once per process and device, before the first step's."""
    device = torch.device(patcher.load_device)
    if device.type == "cpu" or str(device) in _settled:
        return
    q = torch.zeros(WARM_UP_SHAPE, device=device, dtype=torch.float16)
    comfy.ops.scaled_dot_product_attention(q, q, q)
    _settled.add(str(device))


def _schedule_kept(patcher) -> bool:
    current = patcher.get_model_object(NAME)
    return isinstance(current, _CpuTables) or not isinstance(
        current, comfy.model_sampling.ModelSamplingDiscrete
    )


def applied(patcher) -> bool:
    return _schedule_kept(patcher) and settle_attention in patcher.get_all_callbacks(CallbacksMP.ON_PRE_RUN)


def apply(patcher) -> None:
    """Patch ``patcher``'s ``model_sampling`` with :func:`cpu_schedule`'s copy (once; a schedule other than
    ``ModelSamplingDiscrete``'s tables is left as it is), and settle the attention kernel before its first
    run (:func:`settle_attention`)."""
    if not _schedule_kept(patcher):
        patcher.add_object_patch(NAME, cpu_schedule(patcher.get_model_object(NAME)))
    if settle_attention not in patcher.get_all_callbacks(CallbacksMP.ON_PRE_RUN):
        patcher.add_callback_with_key(CallbacksMP.ON_PRE_RUN, CALLBACK_KEY, settle_attention)
