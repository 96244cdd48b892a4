"""The transformer's forward as one CUDA graph for a compiled run: the sampler's, and the int8 MODEL's under
KSampler (``nodes/int8_model/forward.py``'s ``PackForward.begin``, at each run's start).

A compiled forward launches its 28 blocks' kernels from Python, one block graph at a time; where the
kernels are short (the fused 8-bit blocks), the CPU launching them can be slower than the GPU running them,
and the GPU waits. For one run, :func:`graphed` replaces the transformer's forward with :class:`Graphed`:
the first call of a shape runs as before (it compiles, picks its kernels and warms their libraries up), the
second is captured in a CUDA graph (``torch.cuda.graph``) and replayed, and every later call of that shape
copies its inputs into the graph's and replays it: one launch a step. Each call returns its own copy of the
output.

The graphs live for the run and go with it: the weights a run computes with (a LoRA's patched weights,
the expanded copies it holds) are fixed within a run and may be new in the next. A capture that fails
(an operation a graph cannot hold) is logged once, and the run goes on as before.

It is opt-in: ``PIXART_LOWVRAM_CUDA_GRAPH=1`` (:data:`VARIABLE`) graphs a compiled run on a CUDA device
whose weights all stay on it (no streamed blocks, no model ComfyUI loaded in part) without the step cache;
unset or ``0``, no run is graphed. No GPU run has measured it yet (the GPU tier's tests, compute.py's row
with ``"graph": true`` and front.py's *CUDA graph* group do)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

import torch
from torch.utils import _pytree as pytree

logger = logging.getLogger(__name__)

VARIABLE = "PIXART_LOWVRAM_CUDA_GRAPH"


def wanted(device: torch.device | str, compiled: bool, streamed: bool, step_cache: float) -> bool:
    """Whether a run is graphed: compiled, on a CUDA device, its weights resident (``streamed``: blocks
    copied in by hooks between kernels, or a MODEL ComfyUI loaded in part) and every step running every
    block (the step cache decides on the GPU's numbers which blocks run); ``PIXART_LOWVRAM_CUDA_GRAPH`` 1."""
    value = os.environ.get(VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{VARIABLE}={value!r} is not a setting; "
            "set it to 1 (a CUDA graph a step) or 0 (none, the default)."
        )
    if value != "1":
        return False
    return compiled and torch.device(device).type == "cuda" and not streamed and step_cache <= 0


def cuda_capture(run: Callable[[], object]) -> tuple[Callable[[], None], object]:
    """``run`` captured in a CUDA graph: the graph's replay and ``run``'s output (filled by each replay)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()
    return graph.replay, output


class Graphed:
    """A forward that replays a CUDA graph per input signature (:func:`signature`): the first call of a
    signature runs ``forward`` itself, the second captures it (``capture``, :func:`cuda_capture` on a GPU)
    and replays, later ones copy their tensors into the captured inputs and replay."""

    def __init__(self, forward: Callable, capture: Callable):
        self.forward, self.capture = forward, capture
        self.seen: set = set()
        self.graphs: dict = {}
        self.failed: str | None = None

    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = signature(leaves, spec)
        if self.failed is not None or key not in self.seen:
            self.seen.add(key)
            return self.forward(*args, **kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(leaves, spec)
            if entry is None:
                return self.forward(*args, **kwargs)
            self.graphs[key] = entry
        replay, inputs, output = entry
        for held, leaf in zip(inputs, leaves, strict=True):
            if isinstance(held, torch.Tensor):
                held.copy_(leaf)
        replay()
        return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, output)

    def _capture(self, leaves: list, spec):
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        args, kwargs = pytree.tree_unflatten(inputs, spec)
        try:
            replay, output = self.capture(lambda: self.forward(*args, **kwargs))
        except Exception as exc:  # an operation a graph cannot hold: the run goes on without one
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            logger.warning(
                "CUDA graph: a step could not be captured (%s); the run goes on without", self.failed
            )
            return None
        return replay, inputs, output

    def release(self) -> None:
        """Drop the graphs and their tensors (their memory pool goes with the last reference)."""
        self.graphs.clear()
        self.seen.clear()


def signature(leaves: list, spec) -> tuple:
    """What a graph is captured for: the call's structure, each tensor's shape, dtype, device and strides, and
    every other argument's value."""
    return (
        str(spec),
        *(
            (tuple(x.shape), x.dtype, x.device, x.stride()) if isinstance(x, torch.Tensor) else ("value", x)
            for x in leaves
        ),
    )


@contextlib.contextmanager
def graphed(module: torch.nn.Module, enabled: bool) -> Iterator[Graphed | None]:
    """``module``'s forward replayed from CUDA graphs (:func:`cuda_capture`) for the run (``enabled``),
    restored after it."""
    if not enabled:
        yield None
        return
    own = vars(module).get("forward")
    graphs = Graphed(module.forward, cuda_capture)
    module.forward = graphs
    try:
        yield graphs
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
        graphs.release()
