"""Where the MODEL's weights wait between runs: each layer's tensors keep a page-locked host copy in CPU
memory (:class:`HostCopies`), which ComfyUI's load copies to the GPU and its unload puts back in place; a
MODEL loaded without ``keep_loaded`` is unloaded after each sampling run (:func:`release_after`)."""

from __future__ import annotations

import threading
import weakref

import torch

from .. import comfy_models


class HostCopies:
    """A layer of the MODEL whose tensors (its 8-bit weight, scales and bias) keep a host copy in CPU memory,
    page-locked. ComfyUI moves the MODEL with ``Module.to`` (its load, and its unload to the offload device):
    here moving a layer off the CPU copies each tensor from its host copy (asynchronously: a host copy never
    changes) and keeps the host copy; moving it back puts the host copy in place. Nothing is copied back,
    since the weights never change (LoRA patches are added at run time, and a patch ComfyUI writes into a
    bias is undone before it unloads). So a MODEL that leaves the GPU between prompts (``keep_loaded`` off)
    costs one copy at full speed a prompt, not ComfyUI's copy to fresh pageable memory and back. A tensor
    that is not the one made from its host copy (another dtype, one ComfyUI put in its place) moves as torch
    moves it. The device copy is known by a weak reference, so the host copy holds no device memory."""

    COPIED = (("_buffers", "weight"), ("_buffers", "weight_scale"), ("_parameters", "bias"))

    def _apply(self, fn, recurse=True):
        host_copies = self.__dict__.setdefault("_host_copies", {})
        for kind, name in self.COPIED:
            tensor = getattr(self, kind).get(name)
            if tensor is None:
                continue
            target = _placement(fn, tensor)
            if target is None or target[1] != tensor.dtype or target[0] == tensor.device:
                continue
            device = target[0]
            host_copy, made, address, pinned = host_copies.get(name, (None, None, None, False))
            if device.type == "cpu":
                if host_copy is not None and made() is tensor and tensor.data_ptr() == address:
                    self._place(kind, name, host_copy)
            elif tensor.device.type == "cpu":
                if not _is_host_copy(tensor, host_copy):  # a tensor of its own (the first move, or ComfyUI's)
                    host_copy = tensor.detach()
                    pinned = host_copy.is_pinned()
                    if device.type == "cuda" and not pinned:
                        host_copy, pinned = host_copy.pin_memory(), True
                self._place(kind, name, host_copy.to(device, non_blocking=pinned))
                placed = getattr(self, kind)[name]
                host_copies[name] = (host_copy, weakref.ref(placed), placed.data_ptr(), pinned)
        return super()._apply(fn, recurse)

    def _place(self, kind: str, name: str, tensor: torch.Tensor) -> None:
        if kind == "_buffers":
            self._buffers[name] = tensor
            return
        parameter = self._parameters[name]
        try:
            parameter.data = tensor  # the Parameter ComfyUI's patches and backups name stays (CPU and CUDA)
        except RuntimeError:  # tensor types that cannot share a Parameter (the meta device's)
            self._parameters[name] = torch.nn.Parameter(tensor, requires_grad=parameter.requires_grad)


_walks = threading.local()  # per thread: the last walk's function (weakly) and its placements


def _placement(fn, tensor: torch.Tensor) -> tuple[torch.device, torch.dtype] | None:
    """Where, and as what, ``fn`` (``Module._apply``'s: ``to``, ``cuda``, ``cpu``, a dtype change) puts
    ``tensor``; None where there is nothing to copy from (the meta device). torch hands one function to every
    module of a walk (``Module.to`` makes one ``convert`` a call), so each kind of tensor (dtype and device)
    is asked once a walk: asking is a zero-size tensor made and moved, for every tensor of every layer
    otherwise."""
    try:
        ref = weakref.ref(fn)
    except TypeError:  # a callable without weak references: asked for every tensor
        ref = None
    walk = getattr(_walks, "last", None)
    if ref is None or walk is None or walk[0]() is not fn:
        walk = (ref, {})
        if ref is not None:
            _walks.last = walk
    key = (tensor.dtype, tensor.device)
    if key not in walk[1]:
        try:
            made = fn(tensor.new_empty(0))
            walk[1][key] = (made.device, made.dtype)
        except NotImplementedError:  # torch says so in its own walk
            walk[1][key] = None
    return walk[1][key]


def _is_host_copy(tensor: torch.Tensor, host_copy: torch.Tensor | None) -> bool:
    """Whether a layer's CPU tensor is its host copy (put in place by the last move back), page-locked as it
    was made, so that it is neither detached nor asked whether it is page-locked again."""
    return (
        host_copy is not None
        and tensor.data_ptr() == host_copy.data_ptr()
        and tensor.dtype == host_copy.dtype
        and tensor.shape == host_copy.shape
    )


def release_after(executor, *args, **kwargs):
    """``OUTER_SAMPLE`` wrapper of a MODEL loaded without ``keep_loaded``: when the sampling run ends (or
    fails, or is cancelled), ComfyUI unloads the MODEL — every loaded clone of it — to its offload device,
    as it unloads its own models to make room, and only it. Its 8-bit weights wait in their page-locked host
    copies (:class:`HostCopies`); the next run's load copies them back."""
    try:
        return executor(*args, **kwargs)
    finally:
        patcher = executor.class_obj.model_patcher
        comfy_models.unload_alone(
            patcher.load_device, lambda loaded: getattr(loaded.model, "model", None) is patcher.model
        )
