"""The pack's models as ComfyUI models: each one a real ``comfy.model_patcher.ModelPatcher``, placed with
ComfyUI's own ``load_models_gpu``.

Installed as the host of the pack's model cache (``core.pool``), :class:`ComfyModels` makes room for a
fresh load with ``free_memory`` (asking nothing of Dynamic VRAM's models where the version has them: they
give memory back on demand), wraps the loaded model in a :class:`PackModelPatcher` and hands it to
``load_models_gpu`` with the stage's working memory. From then on ComfyUI treats it as one of its own:
it is in ``current_loaded_models`` as a ``LoadedModel`` that ComfyUI made, it is offloaded to CPU memory
when ComfyUI needs the room (a core model's load, ``POST /free`` with ``unload_models``,
``unload_all_models``, an out-of-memory), and Dynamic VRAM's per-node calls see a plain, non-dynamic
patcher. A kept model is held by the pack's cache (ComfyUI holds patchers weakly); the next stage that
uses it hands it to ``load_models_gpu`` again, which moves it back when it was offloaded. A model that is
not kept is unloaded by ComfyUI after its stage (:meth:`ComfyModels.offload`) and its patcher waits in the
pack's host-memory pool for the next stage with the same settings; one the pool drops loses its last
reference, and ComfyUI's own finalizer has nothing left to clean. Offloaded to CPU memory, a patcher keeps
its model's page-locked host copies (``streaming.HostCopy``): a load copies them to the GPU, an unload
drops the device copies.

The patcher is a subclass because these are not ComfyUI's model classes: bitsandbytes 4-bit and
optimum-quanto weights must move whole (``Module.to`` keeps their quantization state; ComfyUI's
per-weight moves, patches and partial loads do not), ``state_dict()`` must not be called on them (it
repacks a bitsandbytes 4-bit weight that ran on the CPU), and a streamed (low-VRAM) model keeps its
blocks in CPU memory wherever its resident parts go.
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Hashable

import comfy.model_management as mm
import comfy.model_patcher
import torch
from comfy.cli_args import args as comfy_args

from ..core import streaming
from ..core.measure import format_bytes
from ..core.pool import ModelCache, cache

logger = logging.getLogger(__name__)

# Where each stage's model goes when ComfyUI offloads it: ComfyUI's choice for its own models of that kind
# (the CPU, or the GPU itself with --highvram / --gpu-only).
OFFLOAD_DEVICES: dict[str, Callable[[], torch.device]] = {
    "text_encoder": mm.text_encoder_offload_device,
    "transformer": mm.unet_offload_device,
    "vae": mm.vae_offload_device,
}
# free_memory(..., for_dynamic=True) (Dynamic VRAM versions): Dynamic VRAM's models count as free room,
# since they give their memory back on demand, and are neither unloaded nor made to drop their RAM copies.
_FREE_FOR_DYNAMIC = "for_dynamic" in inspect.signature(mm.free_memory).parameters


class _Holder(torch.nn.Module):
    """What the patcher holds: ModelPatcher writes its bookkeeping (``device``, ``model_loaded_weight_memory``
    …) onto its model, and a transformers or diffusers model's ``device`` is a read-only property."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner


class PackModelPatcher(comfy.model_patcher.ModelPatcher):
    """A pack model that ComfyUI places, offloads and unloads like its own, always whole. Made by
    :meth:`holding`; its constructor is ComfyUI's own, untouched, since ComfyUI's ``clone()`` calls it with
    whatever arguments the version has (0.38 adds ``fast_disk``)."""

    key: Hashable = None  # the pack cache's key, for the log
    # Its page-locked host copies in CPU memory, made the first time ComfyUI offloads it there: from then on a
    # load copies them to the device and an offload drops the device copies (nothing copied back).
    host_copy: streaming.HostCopy | None = None

    @classmethod
    def holding(
        cls, key: Hashable, model: torch.nn.Module, device: torch.device, offload_device: torch.device
    ) -> PackModelPatcher:
        """The patcher of ``model``, loaded on ``device`` already (straight from the files):
        load_models_gpu registers it as it is."""
        size = max(streaming.bytes_on(model, device), 1)
        holder = _Holder(model)
        holder.device, holder.model_loaded_weight_memory = device, size
        patcher = cls(holder, load_device=device, offload_device=offload_device, size=size)
        patcher.key = key
        return patcher

    @property
    def inner(self) -> torch.nn.Module:
        return self.model.inner

    def _load_list(self, *args, **kwargs) -> list:
        return []  # no per-module sizes (state_dict) and no per-module moves

    def load(
        self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs
    ):
        # Whole, whatever the budget: these weights cannot be split between devices.
        if self.host_copy is not None:
            self.host_copy.to(device_to)
        else:
            streaming.move_model(self.inner, device_to)
        model = self.model
        model.device, model.model_lowvram, model.lowvram_patch_counter = device_to, False, 0
        model.model_loaded_weight_memory, model.model_offload_buffer_memory = self.size, 0
        model.current_weight_patches_uuid = self.patches_uuid

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False) -> int:
        return 0  # never piecewise: ComfyUI then unloads it whole

    def unpatch_model(self, device_to=None, unpatch_weights=True) -> None:
        super().unpatch_model(None, unpatch_weights)  # ComfyUI's bookkeeping, no per-weight moves
        if unpatch_weights and device_to is not None:
            device_to = torch.device(device_to)
            if device_to.type != "cpu":  # --highvram / --gpu-only: the offload device is the GPU itself
                streaming.move_model(self.inner, device_to)
            elif self.host_copy is None:
                self.host_copy = streaming.HostCopy(self.inner)
            else:
                self.host_copy.back()
            self.model.device = device_to
            logger.info("ComfyUI moved pack model %s to %s", self.key, device_to)


class ComfyModels:
    """The cache's host (``core.pool.CacheHost``) inside ComfyUI."""

    def make_room(self, needs: int, device: torch.device) -> None:
        # As load_models_gpu does for core models: CPU memory is not managed, and the reserve ComfyUI
        # keeps for other applications (--reserve-vram) comes on top.
        if device.type == "cpu":
            return
        logger.debug("asking ComfyUI for %.2f GiB on %s", needs / 2**30, device)
        extra = {"for_dynamic": True} if _FREE_FOR_DYNAMIC else {}
        mm.free_memory(needs + mm.extra_reserved_memory(), device, **extra)

    def hold(self, key: Hashable, model: torch.nn.Module, device: torch.device) -> PackModelPatcher:
        stage = key[0] if isinstance(key, tuple) else None
        offload = OFFLOAD_DEVICES.get(stage, mm.unet_offload_device)()
        return PackModelPatcher.holding(key, model, device, offload)

    def ready(self, patcher: PackModelPatcher, work: int) -> torch.nn.Module:
        # Registered with ComfyUI, or moved back to its device when ComfyUI offloaded it since.
        mm.load_models_gpu(
            [patcher], memory_required=work, minimum_memory_required=work, force_full_load=True
        )
        return patcher.inner

    def offload(self, patcher: PackModelPatcher) -> None:
        unload_alone(patcher.load_device, lambda loaded: loaded.model is patcher)


def unload_alone(device: torch.device, mine: Callable[[object], bool]) -> None:
    """ComfyUI unloads the loaded models that ``mine`` picks (each a ``LoadedModel``) as it unloads its own to
    make room (``LoadedModel.model_unload``, to their offload device), and only them: every other loaded model
    stays."""
    others = [loaded for loaded in mm.current_loaded_models if not mine(loaded)]
    mm.free_memory(1e30, device, keep_loaded=others)


def install(cache: ModelCache) -> ComfyModels:
    """Make ComfyUI's model management the cache's host (once, when the nodes load). With ``--cache-none``
    ComfyUI keeps no node between prompts, and the pack keeps no model in host memory either."""
    if not isinstance(cache.host, ComfyModels):
        cache.host = ComfyModels()
    if getattr(comfy_args, "cache_none", False):
        cache.host_budget = 0
    return cache.host


# The pack's model nodes: while ComfyUI holds one of their node objects, it holds the pack's models.
MODEL_NODES = ("PixArtQ_T5Encode", "PixArtQ_Sampler", "PixArtQ_VAEDecode")


class ModelNodeObjects:
    """The count of ComfyUI's live node objects of the pack's model nodes, which hold the pack's models (kept,
    or waiting in host memory): when the last one goes, the models go.

    ComfyUI makes one object per node of a prompt and keeps it in its object cache, beside the node's
    outputs, until a prompt no longer has that node or ``POST /free`` with ``free_memory`` (the front end's
    Free model and node cache) drops its caches. The pack's models outlive each node's outputs (a new text or
    seed is a new output, and the models serve it), so they follow the node objects instead: when ComfyUI
    lets go of the last object of the pack's model nodes, the pack lets go of its models — unless the prompt
    starting then has pack model nodes of its own (another workflow of the pack), whose objects take over.
    This is how ComfyUI's own loaders' models leave memory with its node cache, and the only signal
    ``/free`` gives: custom nodes get no call."""

    def __init__(self, cache: ModelCache):
        self.cache = cache
        self.alive = 0

    def add(self, node: object) -> None:
        self.alive += 1
        weakref.finalize(node, self._let_go).atexit = False

    def _let_go(self) -> None:
        self.alive -= 1
        if self.alive > 0 or running_prompt_has_model_nodes():
            return
        kept, pooled, size = len(self.cache), len(self.cache.pooled()), self.cache.pool_bytes()
        if not kept and not pooled:
            return
        # Garbage collection is ComfyUI's to run here: this may be a finalizer inside one.
        self.cache.clear(collect=False)
        logger.info(
            "ComfyUI let go of the pack's nodes: dropped %d kept model(s) and %d from host memory (%s)",
            kept,
            pooled,
            format_bytes(size),
        )


def _running_items() -> list:
    """The server's running queue items, (number, prompt id, prompt, …); none outside a server."""
    server = sys.modules.get("server")  # ComfyUI's; never imported here (a finalizer may ask)
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    queue = getattr(instance, "prompt_queue", None)
    if queue is None:
        return []
    running, _queued = queue.get_current_queue_volatile()
    return running


def running_prompt_has_model_nodes() -> bool:
    """Whether the prompt the server is running has a node of the pack's model nodes (False outside a
    server, or between prompts)."""
    return any(
        isinstance(node, dict) and node.get("class_type") in MODEL_NODES
        for item in _running_items()
        for node in item[2].values()
    )


def running_prompt(prompt_id: str) -> dict | None:
    """The prompt (API format, as queued) the server is running under ``prompt_id``; None outside a server."""
    return next((item[2] for item in _running_items() if item[1] == prompt_id), None)


MODEL_NODE_OBJECTS = ModelNodeObjects(cache)


class HoldsModels:
    """The model nodes' base beside ``io.ComfyNode``: each node object ComfyUI makes holds the pack's models
    (:class:`ModelNodeObjects`)."""

    def __init__(self) -> None:
        super().__init__()
        MODEL_NODE_OBJECTS.add(self)
