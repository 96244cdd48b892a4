"""A PixArt-Σ MODEL's noise schedule computed on the CPU wherever the model lies, so that KSampler gives
the same sigmas, and so the same image, for the same prompt and seed.

KSampler computes its sigmas (``comfy.samplers.calculate_sigmas``: ``model_sampling.sigma`` and
``timestep`` over ``log_sigmas``) before it loads the model. ComfyUI's ``ModelSamplingDiscrete`` keeps
``sigmas`` and ``log_sigmas`` as buffers of the model (``set_sigmas``: ``register_buffer``, the same in
v0.3.64, v0.8.0 and v0.33.0), which move with it: in the first prompt after a load they are on the CPU, in
every later one on the GPU, and the GPU's ``log``/``exp`` round differently from the CPU's (H200,
2026-12-02: 5 of 21 sigmas of a 20-step ``normal`` schedule differed, by up to 4.8e-7), so the first
prompt's image differed from a repeat of it. ComfyUI's ``sigma`` and ``timestep`` already move their input
to the tables' device and the result back; :func:`apply` gives the MODEL, as an object patch (``ModelPatcher.
add_object_patch``, what ComfyUI's ModelSampling nodes use), a copy of its ``model_sampling`` whose tables
are plain attributes on the CPU, which ``Module.to`` leaves where they are."""

from __future__ import annotations

import copy
import functools

import comfy.model_sampling
import torch

NAME = "model_sampling"


class _CpuTables:
    """Keeps ``sigmas`` and ``log_sigmas`` as plain CPU tensors (not buffers) when they are set."""

    def set_sigmas(self, sigmas: torch.Tensor) -> None:
        # As ComfyUI's: the log taken in the schedule's own dtype (float64), then both as float32.
        self.keep(sigmas.float(), sigmas.log().float())

    def keep(self, sigmas: torch.Tensor, log_sigmas: torch.Tensor) -> None:
        for name in ("sigmas", "log_sigmas"):
            self._buffers.pop(name, None)
        self.sigmas, self.log_sigmas = sigmas.detach().cpu(), log_sigmas.detach().cpu()


@functools.cache
def _cpu_class(base: type) -> type:
    return type(f"{base.__name__}OnCpu", (_CpuTables, base), {})


def cpu_schedule(model_sampling: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model_sampling`` (a ``ModelSamplingDiscrete``) whose tables stay on the CPU; the values
    are the CPU's, as ComfyUI computes them when it builds the model."""
    stable = copy.deepcopy(model_sampling)
    tables = stable.sigmas, stable.log_sigmas
    stable.__class__ = _cpu_class(type(model_sampling))
    stable.keep(*tables)
    return stable


def applied(patcher) -> bool:
    return isinstance(patcher.get_model_object(NAME), _CpuTables)


def apply(patcher) -> None:
    """Patch ``patcher``'s ``model_sampling`` with :func:`cpu_schedule`'s copy (once; a schedule other than
    ``ModelSamplingDiscrete``'s tables is left as it is)."""
    current = patcher.get_model_object(NAME)
    if isinstance(current, _CpuTables) or not isinstance(current, comfy.model_sampling.ModelSamplingDiscrete):
        return
    patcher.add_object_patch(NAME, cpu_schedule(current))
