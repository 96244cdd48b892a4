"""The sampler's schedules: the diffusers schedulers it offers, built from the model's own scheduler config,
and the shorter schedule an image-to-image run (denoise below 1) takes."""

from __future__ import annotations

import functools
import math

# name -> (diffusers scheduler class, settings over the model's own scheduler config)
_SCHEDULERS: dict[str, tuple[str, dict]] = {
    "dpmsolver++": ("DPMSolverMultistepScheduler", {}),
    "dpmsolver++_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "dpmsolver++_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_ancestral": ("EulerAncestralDiscreteScheduler", {}),
    # DDIM's default clips the predicted sample to [-1, 1], which suits pixels, not these latents.
    "ddim": ("DDIMScheduler", {"clip_sample": False}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "deis": ("DEISMultistepScheduler", {}),
}
SCHEDULERS: tuple[str, ...] = tuple(_SCHEDULERS)
DEFAULT_SCHEDULER = "dpmsolver++"  # what PixArt-Σ ships: the model folder's scheduler config as it is


def steps_to_run(steps: int, denoise: float) -> int:
    """How many of the ``steps`` steps a ``denoise`` runs: the last ``steps × denoise``, rounded half up,
    and at least one while denoise is above 0."""
    if denoise >= 1:
        return steps
    if denoise <= 0:
        return 0
    return max(1, math.floor(steps * denoise + 0.5))


class _StartsLater:
    """Mixed into a diffusers scheduler: ``set_timesteps`` drops the first ``skip`` steps of the schedule it
    makes (image-to-image). PixArtSigmaPipeline runs every step its scheduler holds and offers no start
    step; cutting the per-step arrays (timesteps, and sigmas where the scheduler has them) together
    leaves the scheduler a consistent, shorter schedule: its step index, its multistep warm-up and its
    lower-order final step all follow the steps that run."""

    skip = 0

    def set_timesteps(self, *args, **kwargs) -> None:
        super().set_timesteps(*args, **kwargs)
        if self.skip:
            self.timesteps = self.timesteps[self.skip :]
            if getattr(self, "sigmas", None) is not None:
                self.sigmas = self.sigmas[self.skip :]


@functools.cache
def _scheduler_class(name: str) -> type:
    import diffusers

    base = getattr(diffusers, name)
    return type(base.__name__, (_StartsLater, base), {})


def make_scheduler(name: str, config: dict, skip: int = 0):
    """Scheduler ``name`` built from the model's scheduler config (so its betas and timestep spacing carry
    over), running all but the first ``skip`` steps of the schedules it is set to."""
    class_name, settings = _SCHEDULERS[name]
    scheduler = _scheduler_class(class_name).from_config(config, **settings)
    scheduler.skip = skip
    return scheduler
