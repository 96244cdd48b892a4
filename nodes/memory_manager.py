"""The pack's kept models in ComfyUI's own memory manager (``comfy.model_management``).

Each kept model is entered in ``current_loaded_models`` as a :class:`KeptEntry`, so ComfyUI counts it
and unloads it as one of its own: ``POST /free`` with ``unload_models``, ``unload_all_models()`` and
``free_memory(needed, device)`` when a core model loads all end in ``KeptEntry.model_unload``, which
drops the model from the pack's cache. Before a pack stage loads, ``make_room`` asks ``free_memory`` for
the stage's estimate, so ComfyUI unloads its models (and the pack's other kept ones) to fit it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Hashable

import comfy.model_management as mm
import torch

from ..core.cache import ModelCache

logger = logging.getLogger(__name__)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _bytes(model: torch.nn.Module, device: torch.device) -> int:
    """The bytes of the model's parameters and buffers that are on ``device`` (4-bit weights count as
    packed): all of them for a model kept whole, the resident parts of a streamed one (low-VRAM mode
    keeps its blocks in CPU memory). Not ComfyUI's ``module_size``: that counts every tensor wherever it
    is and calls ``state_dict()``, and bitsandbytes' state_dict unpacks a 4-bit weight that has run on
    the CPU in place — the kept model's next run then takes another kernel path and gives slightly
    different numbers."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values() if _on(t, device))


class KeptModel:
    """The part of a ModelPatcher that ``model_management`` reads, for one kept model. ComfyUI holds it
    weakly (``LoadedModel._model``); :class:`ComfyMemory` holds it while the model is kept."""

    parent = None  # not a clone of another patcher

    def __init__(self, cache: ModelCache, key: Hashable, model: torch.nn.Module, device: torch.device):
        self.cache, self.key, self.model = cache, key, model
        self.load_device = device
        self.offload_device = torch.device("cpu")
        self.size = _bytes(model, device)
        self.unloading = False  # set while ComfyUI's free_memory unloads it (it pops the entry itself)

    def model_size(self) -> int:
        return self.size

    def loaded_size(self) -> int:
        return self.size  # what unloading it gives back on its device

    def current_loaded_device(self) -> torch.device:
        return self.load_device

    def is_clone(self, other) -> bool:
        return False

    def model_patches_models(self) -> list:
        return []

    def detach(self, unpatch_all: bool = True) -> None:
        """Unloading a kept model drops it: the pack loads it again when a node needs it."""
        self.cache.evict(self.key)


class KeptEntry(mm.LoadedModel):
    """A kept model as ``current_loaded_models`` lists it. It is never "currently used" (core nodes that
    reload the models in use, e.g. a ControlNet's VAE encode, leave it alone) and unloads whole: quantized
    weights are not moved piecewise."""

    def __init__(self, kept: KeptModel):
        super().__init__(kept)
        self.currently_used = False
        self.real_model = weakref.ref(kept.model)

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        kept = self.model
        if kept is not None:
            kept.unloading = True
            kept.detach()
        return True

    def model_use_more_vram(self, extra_memory, force_patch_weights=False) -> int:
        return 0


class ComfyMemory:
    """The cache's host (core.cache.CacheHost) inside ComfyUI."""

    def __init__(self, cache: ModelCache):
        self.cache = cache
        self._kept: dict[Hashable, KeptModel] = {}

    def make_room(self, needs: int, device: torch.device) -> None:
        # As load_models_gpu does for core models: CPU memory is not managed, and the reserve ComfyUI
        # keeps for other applications (--reserve-vram) comes on top.
        if device.type == "cpu":
            return
        logger.debug("asking ComfyUI for %.2f GiB on %s", needs / 2**30, device)
        mm.free_memory(needs + mm.extra_reserved_memory(), device)

    def kept(self, key: Hashable, model: torch.nn.Module, device: torch.device) -> None:
        self.released(key)
        kept = self._kept[key] = KeptModel(self.cache, key, model, device)
        mm.current_loaded_models.insert(0, KeptEntry(kept))

    def released(self, key: Hashable) -> None:
        kept = self._kept.pop(key, None)
        if kept is None:
            return
        kept.model = None
        if kept.unloading:
            return  # free_memory is iterating current_loaded_models by index and pops the entry itself
        mm.current_loaded_models[:] = [
            entry
            for entry in mm.current_loaded_models
            if not (isinstance(entry, KeptEntry) and entry.model is kept)
        ]


def install(cache: ModelCache) -> ComfyMemory:
    """Make ComfyUI's memory manager the cache's host (once, when the nodes load)."""
    if not isinstance(cache.host, ComfyMemory):
        cache.host = ComfyMemory(cache)
    return cache.host
