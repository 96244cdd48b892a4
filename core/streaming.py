"""A model's repeated blocks get their weights in running form just before each runs, and drop them after.

Two uses of one mechanism (``BlockStreamer``): before block *i* runs, its weights are made ready —
ahead of time, on a side stream, while block *i − 1* computes — and after it has run the ready copies are
dropped. The stored tensors are never replaced, so nothing is copied back.

* Low-VRAM mode, ``stream_blocks(model, blocks, device)``: the blocks' weights stay in CPU memory;
  every other weight of the model goes to ``device`` for good (small: norms, projections, embedders);
  "ready" means copied to the GPU.
* The fast sampler path, ``expand=True`` (``expand_blocks`` when the model is on the GPU already):
  optimum-quanto int8/float8 weights are expanded to the compute dtype (``QTensor.dequantize()``), so the
  block's matrix products run as plain fp16 ones — compiled, faster than quanto's per-call kernels —
  while only the blocks in flight hold 16-bit copies.

Why not diffusers' group offloading or accelerate's offload hooks: both move a tensor by assigning
``param.data``, which carries neither bitsandbytes' ``quant_state`` (the 4-bit absmax beside the
packed weight) nor the scale inside an optimum-quanto tensor subclass; accelerate re-quantizes a
``Params4bit`` it is given. Here each parameter is replaced by the tensor its own ``.to(device)``
returns — the one path both libraries implement — and put back afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

_TensorSlot = tuple[torch.nn.Module, str, str]  # module, "_parameters" | "_buffers", name


def _slots(module: torch.nn.Module) -> list[_TensorSlot]:
    slots = []
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, kind).items():
                if tensor is not None:
                    slots.append((sub, kind, name))
    return slots


def _pin(tensor: torch.Tensor) -> None:
    """Page-lock a CPU tensor's storage in place where its type allows (plain tensors, bitsandbytes'
    packed weights), so copies to the GPU run asynchronously; tensor subclasses stay as they are."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and not hasattr(tensor, "quant_state"):
        return
    if tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor.data = tensor.data.pin_memory()


def _expanded(tensor: torch.Tensor) -> torch.Tensor:
    """An optimum-quanto weight as a plain tensor in its float dtype; any other tensor as it is."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor
    from optimum.quanto import QTensor

    return tensor.dequantize() if isinstance(tensor, QTensor) else tensor


class _Block:
    def __init__(self, module: torch.nn.Module, device: torch.device, expand: bool):
        self.module = module
        self.device = device
        self.expand = expand
        self.slots = _slots(module)
        self.originals = [getattr(m, kind)[name] for m, kind, name in self.slots]
        self.ready: torch.cuda.Event | None = None  # set while a prefetch is in flight
        self.loaded = False

    def load(self, stream: torch.cuda.Stream | None) -> None:
        if self.loaded:
            return
        for (m, kind, name), tensor in zip(self.slots, self.originals, strict=True):
            ready = tensor
            if ready.device != self.device:  # (on the CPU itself, a copy would only cost)
                ready = ready.to(self.device, non_blocking=stream is not None)
            if self.expand:
                ready = _expanded(ready)
            if ready is not tensor:
                getattr(m, kind)[name] = ready
        self.loaded = True
        if stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def unload(self) -> None:
        for (m, kind, name), tensor in zip(self.slots, self.originals, strict=True):
            getattr(m, kind)[name] = tensor
        self.loaded = False
        self.ready = None


class BlockStreamer:
    """The hooks and state of one streamed model (the hooks hold it: it lives as long as the model)."""

    def __init__(
        self, blocks: list[torch.nn.Module], device: torch.device, prefetch: bool, expand: bool = False
    ):
        self.device = device
        self.blocks = [_Block(block, device, expand) for block in blocks]
        self.stream = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._before(index))
            block.register_forward_hook(self._after(index))

    def _before(self, index: int):
        def hook(_module, _args):
            block = self.blocks[index]
            if block.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(block.ready)
            block.load(None)  # not prefetched (the first block of a forward)
            following = index + 1
            if self.stream is not None and following < len(self.blocks):
                # The side stream first waits for the work queued so far: the GPU memory it is about to
                # allocate may be what an earlier block's dropped copies held, still read by that work.
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    self.blocks[following].load(self.stream)

        return hook

    def _after(self, index: int):
        def hook(_module, _args, _output):
            self.blocks[index].unload()

        return hook


def stream_blocks(
    model: torch.nn.Module,
    blocks: Iterable[torch.nn.Module],
    device: torch.device | str,
    keep_on_cpu: Iterable[torch.nn.Module] = (),
    prefetch: bool = True,
    expand: bool = False,
) -> BlockStreamer:
    """Run ``model`` on ``device`` with ``blocks`` streamed from CPU memory (see the module's doc).

    ``model`` must be on the CPU. Modules in ``keep_on_cpu`` stay there and run there (their inputs are
    moved to the CPU and their outputs to ``device``): for T5's token embeddings (263 MB in bf16 for
    T5-XXL), a lookup that costs nothing on the CPU. The streamed blocks' CPU weights are page-locked
    where possible so the copies overlap with compute. ``expand`` also expands quantized weights once on
    the GPU (the fast sampler path, streamed)."""
    device = torch.device(device)
    blocks = list(blocks)
    keep_on_cpu = list(keep_on_cpu)
    skip = {id(t) for module in blocks + keep_on_cpu for t in [*module.parameters(), *module.buffers()]}
    for m, kind, name in _slots(model):
        tensor = getattr(m, kind)[name]
        if id(tensor) not in skip:
            moved = tensor.to(device)
            getattr(m, kind)[name] = (
                torch.nn.Parameter(moved, requires_grad=False)
                if kind == "_parameters" and type(moved) is torch.Tensor
                else moved
            )
    if device.type == "cuda":
        for block in blocks:
            for tensor in [*block.parameters(), *block.buffers()]:
                _pin(tensor)
    for module in keep_on_cpu:
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: (
                tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args),
                {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
            ),
            with_kwargs=True,
        )
        module.register_forward_hook(lambda _m, _args, output: output.to(device))
    return BlockStreamer(blocks, device, prefetch, expand)


def expand_blocks(blocks: Iterable[torch.nn.Module], device: torch.device | str) -> BlockStreamer:
    """Expand the blocks' quantized weights (on ``device`` already) to their float dtype one block at a
    time, the next one on a side stream while the current one runs (see the module's doc)."""
    device = torch.device(device)
    return BlockStreamer(list(blocks), device, prefetch=True, expand=True)
