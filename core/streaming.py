"""Low-VRAM mode: a model's repeated blocks stay in CPU memory and each goes to the GPU only while it runs.

``stream_blocks(model, blocks, device)`` leaves the blocks' weights where they are (CPU), puts every
other weight of the model on ``device`` for good (small: norms, projections, embedders), and hooks each
block: before block *i* runs its weights are on the GPU — copied ahead of time on a side stream while
block *i − 1* computed — and after it has run the GPU copies are dropped. The CPU tensors are never
replaced, so nothing is copied back.

Why not diffusers' group offloading or accelerate's offload hooks: both move a tensor by assigning
``param.data``, which carries neither bitsandbytes' ``quant_state`` (the 4-bit absmax beside the
packed weight) nor the scale inside an optimum-quanto tensor subclass; accelerate re-quantizes a
``Params4bit`` it is given. Here each parameter is replaced by the tensor its own ``.to(device)``
returns — the one path both libraries implement — and put back afterwards.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

_TensorSlot = tuple[torch.nn.Module, str, str]  # module, "_parameters" | "_buffers", name

# Bytes the pack has copied from CPU memory to a device in this process: streamed blocks and models moved
# whole (:func:`move_model`); reads from disk straight to the device are not counted. For benchmarks,
# which report it per prompt (user cards copy at PCIe speeds, a quarter of a data-centre host's).
_copied_to_device = 0


def copied_to_device() -> int:
    """Bytes copied from CPU memory to a device so far (see ``_copied_to_device``)."""
    return _copied_to_device


def _count(tensor: torch.Tensor, device: torch.device) -> None:
    global _copied_to_device
    if tensor.device.type == "cpu" and device.type != "cpu":
        _copied_to_device += tensor.numel() * tensor.element_size()


def to_device(tensor: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """A copy of ``tensor`` on ``device`` for a run, leaving ``tensor`` — a host copy — as it is.

    bitsandbytes' ``Params4bit.to`` moves the weight's ``quant_state`` (its absmax, 70 MiB for T5-XXL in
    nf4) in place and shares it with the copy, so the host copy's state would stay on the device after the
    run; here the copy gets a state of its own. A parameter stays a parameter (``Tensor.to`` returns a plain
    tensor), so code compiled for the model sees the same types on every run."""
    state = getattr(tensor, "quant_state", None)
    if state is None:
        moved = tensor.to(device, non_blocking=non_blocking)
        if isinstance(tensor, torch.nn.Parameter) and type(moved) is torch.Tensor:
            moved = torch.nn.Parameter(moved, requires_grad=False)
        return moved
    own = copy.copy(state)
    if getattr(state, "nested", False):
        own.state2 = copy.copy(state.state2)
    # What QuantState.to moves, moved here (asynchronously where the host copy is page-locked); its own .to,
    # which bitsandbytes then calls, finds them there.
    for holder, name in _state_tensors(own):
        setattr(holder, name, getattr(holder, name).to(device, non_blocking=non_blocking))
    tensor.quant_state = own
    try:
        return tensor.to(device, non_blocking=non_blocking)
    finally:
        tensor.quant_state = state


def _state_tensors(state) -> list[tuple[object, str]]:
    """The tensors of a bitsandbytes ``QuantState`` that its ``.to`` moves, as (holder, attribute)."""
    found = [(state, "absmax"), (state, "code")]
    if getattr(state, "nested", False):
        found += [(state, "offset"), (state.state2, "absmax"), (state.state2, "code")]
    return [(holder, name) for holder, name in found if isinstance(getattr(holder, name), torch.Tensor)]


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


class _Block:
    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module = module
        self.device = device
        self.slots = _slots(module)
        self.originals = [getattr(m, kind)[name] for m, kind, name in self.slots]
        self.ready: torch.cuda.Event | None = None  # set while a prefetch is in flight
        self.loaded = False

    def load(self, stream: torch.cuda.Stream | None) -> None:
        if self.loaded:
            return
        for (m, kind, name), tensor in zip(self.slots, self.originals, strict=True):
            if tensor.device != self.device:  # (on the CPU itself, a copy would only cost)
                getattr(m, kind)[name] = to_device(tensor, self.device, non_blocking=stream is not None)
                _count(tensor, self.device)
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
    """The hooks and state of one streamed model (the hooks and the model hold it: it lives as long as the
    model). ``resident``: the model's tensors outside the blocks that live on the device."""

    def __init__(
        self, blocks: list[torch.nn.Module], device: torch.device, prefetch: bool, resident: list[_TensorSlot]
    ):
        self.device = device
        self.resident = resident
        self.blocks = [_Block(block, device) for block in blocks]
        self.stream = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._before(index))
            block.register_forward_hook(self._after(index))

    def move_resident(self, device: torch.device | str) -> None:
        """Move the resident parts (not the blocks, which stay in CPU memory) to ``device``: how a host
        offloads a streamed model and brings it back."""
        for m, kind, name in self.resident:
            _move(m, kind, name, torch.device(device))

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
) -> BlockStreamer:
    """Run ``model`` on ``device`` with ``blocks`` streamed from CPU memory (see the module's doc).

    ``model`` must be on the CPU. Modules in ``keep_on_cpu`` stay there and run there (their inputs are
    moved to the CPU and their outputs to ``device``): for T5's token embeddings (263 MB in bf16 for
    T5-XXL), a lookup that costs nothing on the CPU. The streamed blocks' CPU weights are page-locked
    where possible so the copies overlap with compute."""
    device = torch.device(device)
    blocks = list(blocks)
    keep_on_cpu = list(keep_on_cpu)
    skip = {id(t) for module in blocks + keep_on_cpu for t in [*module.parameters(), *module.buffers()]}
    resident = [slot for slot in _slots(model) if id(getattr(slot[0], slot[1])[slot[2]]) not in skip]
    for m, kind, name in resident:
        _move(m, kind, name, device)
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
    streamer = BlockStreamer(blocks, device, prefetch, resident)
    model.__dict__[_STREAMER] = streamer
    return streamer


_STREAMER = "_pixart_lowvram_streamer"


def streamer_of(model: torch.nn.Module) -> BlockStreamer | None:
    """The streamer of a model that :func:`stream_blocks` set up; None for a model kept whole."""
    return model.__dict__.get(_STREAMER)


def _move(module: torch.nn.Module, kind: str, name: str, device: torch.device) -> None:
    moved = getattr(module, kind)[name].to(device)
    getattr(module, kind)[name] = (
        torch.nn.Parameter(moved, requires_grad=False)
        if kind == "_parameters" and type(moved) is torch.Tensor
        else moved
    )


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def bytes_on(model: torch.nn.Module, device: torch.device | str) -> int:
    """The bytes of the model's parameters and buffers that are on ``device`` (4-bit weights count as
    packed): all of them for a model kept whole, the resident parts of a streamed one (its blocks stay in
    CPU memory). Not ``state_dict()``: bitsandbytes' state_dict unpacks a 4-bit weight that has run on the
    CPU in place, and the model's next run then takes another kernel path."""
    device = torch.device(device)
    return sum(t.numel() * t.element_size() for t in _tensors(model) if _on(t, device))


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of all the model's parameters and buffers, wherever they are."""
    return sum(t.numel() * t.element_size() for t in _tensors(model))


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers, each once (a tied weight is one tensor)."""
    return list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def move_model(model: torch.nn.Module, device: torch.device | str) -> None:
    """Move a pack model whole (``Module.to``, which keeps bitsandbytes' ``quant_state`` and quanto's
    scales with their weights): only its resident parts when its blocks are streamed from CPU memory."""
    device = torch.device(device)
    streamer = streamer_of(model)
    before = 0 if device.type == "cpu" else bytes_on(model, CPU)
    if streamer is not None:
        streamer.move_resident(device)
    else:
        model.to(device)
    if before:
        global _copied_to_device
        _copied_to_device += before - bytes_on(model, CPU)


CPU = torch.device("cpu")


def pin(tensor: torch.Tensor) -> None:
    """Page-lock a CPU tensor in place, so copies from it to the GPU run at full speed and asynchronously:
    a plain tensor's or a bitsandbytes weight's storage, a wrapper subclass's inner tensors (optimum-quanto's
    ``_data`` and ``_scale``). Nothing without CUDA, or for a tensor elsewhere."""
    if tensor.device.type != "cpu" or not torch.cuda.is_available():
        return
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        names, _context = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if not inner.is_pinned():
                setattr(tensor, name, inner.pin_memory())
    elif not tensor.is_pinned():
        tensor.data = tensor.data.pin_memory()


_BLOCKS = "_pixart_lowvram_blocks"


def copy_ahead(model: torch.nn.Module, blocks: Iterable[torch.nn.Module]) -> None:
    """Mark ``blocks`` (run in this order, each once or more per run) as ones whose weights a
    :class:`HostCopy` may copy to the device while the blocks before them compute. Only for a model whose
    run reads each block's weights inside that block's forward (T5's layers; not a transformer whose weights
    are expanded before the run)."""
    model.__dict__[_BLOCKS] = list(blocks)


def pin_attribute(holder: object, name: str) -> None:
    """Page-lock the CPU tensor ``holder.name`` (a bitsandbytes quantization state's), in place."""
    tensor = getattr(holder, name)
    if tensor.device.type == "cpu" and torch.cuda.is_available() and not tensor.is_pinned():
        setattr(holder, name, tensor.pin_memory())


class HostCopy:
    """A model kept whole in (page-locked) CPU memory: its tensors there are its host copies. For a run each
    is copied to the device; after it the device copies are dropped and the host copies put back — nothing
    is copied back, since the weights never change. The first :class:`HostCopy` of a model on the GPU moves
    it to CPU memory once. A streamed model (:func:`stream_blocks`) keeps its blocks as they are and only its
    resident parts move.

    For a model with :func:`copy_ahead` blocks, the parts outside them are copied first on the current
    stream and the blocks' on a side stream in their order, each block's forward waiting only for its own
    copies: the run starts as soon as its first weights are there, and the copies of T5-XXL's 2.5 GiB (about
    0.1 s at PCIe 4.0 speeds) run under the encode."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        move_model(model, CPU)
        self.device = CPU  # where the model is now
        self.streamer = streamer_of(model)
        if self.streamer is not None:
            return
        self.slots = _slots(model)
        self.host_copies = [getattr(m, kind)[name] for m, kind, name in self.slots]
        for tensor in self.host_copies:
            pin(tensor)
            state = getattr(tensor, "quant_state", None)
            for holder, name in [] if state is None else _state_tensors(state):
                pin_attribute(holder, name)
        blocks = model.__dict__.get(_BLOCKS, [])
        owner = {id(m): index for index, block in enumerate(blocks) for m in block.modules()}
        # Slot indices outside the blocks, then each block's.
        self.outside = [i for i, (m, _kind, _name) in enumerate(self.slots) if id(m) not in owner]
        self.per_block = [
            [i for i, (m, _kind, _name) in enumerate(self.slots) if owner.get(id(m)) == index]
            for index in range(len(blocks))
        ]
        self.ready: list[torch.cuda.Event | None] = [None] * len(blocks)
        self.stream: torch.cuda.Stream | None = None
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._wait(index))

    def _wait(self, index: int):
        def hook(_module, _args):
            event, self.ready[index] = self.ready[index], None
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

        return hook

    def to(self, device: torch.device) -> None:
        """The model on ``device`` for a run (copies queued on the current stream; with copy-ahead blocks,
        theirs on a side stream, see the class). Nothing when it is there already."""
        device = torch.device(device)
        if device == self.device or device.type == "cpu":
            return
        self.device = device
        if self.streamer is not None:
            move_model(self.model, device)
            return
        ahead = device.type == "cuda" and bool(self.per_block)
        if ahead:
            if self.stream is None:
                self.stream = torch.cuda.Stream(device)
            # The side stream's copies may take memory that the work queued so far still reads (the device
            # copies of the last run, dropped when it ended): they start after that work.
            self.stream.wait_stream(torch.cuda.current_stream(device))
        moved: dict[int, torch.Tensor] = {}  # tied weights (T5's shared and embed_tokens) copied once

        def place(indices: list[int]) -> None:
            for i in indices:
                (m, kind, name), host_copy = self.slots[i], self.host_copies[i]
                if id(host_copy) not in moved:
                    moved[id(host_copy)] = to_device(host_copy, device, non_blocking=True)
                    _count(host_copy, device)
                getattr(m, kind)[name] = moved[id(host_copy)]

        place(self.outside)  # first, on the current stream: the run's first layers read them
        for index, indices in enumerate(self.per_block):
            if ahead:
                with torch.cuda.stream(self.stream):
                    place(indices)
                self.ready[index] = self.stream.record_event()
            else:
                place(indices)

    def back(self) -> None:
        """The model in CPU memory again, its device copies dropped."""
        if self.device == CPU:
            return
        self.device = CPU
        if self.streamer is not None:
            move_model(self.model, CPU)
            return
        self.ready = [None] * len(self.ready)
        for (m, kind, name), host_copy in zip(self.slots, self.host_copies, strict=True):
            getattr(m, kind)[name] = host_copy
