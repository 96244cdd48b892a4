"""The tests' tools for core/step_graph.py's graphs (the sampler's and the int8 MODEL's).

:class:`StandIn` is a CUDA graph's capture on the CPU that keeps a graph's contract: the captured call's
output tensors are the ones every replay fills, computed from the captured inputs' tensors; so a call whose
inputs were not copied in, or whose output is the graph's own buffer, gives wrong numbers here as on a GPU.
:func:`with_and_without_graph` runs a GPU run without the graph, then twice with it."""

from __future__ import annotations

import logging

from torch.utils import _pytree as pytree

from pixart_lowvram.core import step_graph


class StandIn:
    """A capture on the CPU: the output of the captured call; a replay computes the call again from the
    captured inputs into that output's tensors."""

    def __init__(self, fail: BaseException | None = None):
        self.captures = self.replays = 0
        self.fail = fail

    def __call__(self, run):
        if self.fail is not None:
            raise self.fail
        self.captures += 1
        output = run()

        def replay():
            self.replays += 1
            for held, fresh in zip(pytree.tree_leaves(output), pytree.tree_leaves(run()), strict=True):
                held.copy_(fresh)

        return replay, output


def with_and_without_graph(run, monkeypatch, caplog) -> tuple:
    """``run()``'s output with ``PIXART_LOWVRAM_CUDA_GRAPH=0``, then with ``1`` twice, each run capturing
    once (its graphs go with it) and no capture failing."""
    monkeypatch.setenv(step_graph.VARIABLE, "0")
    plain = run()
    monkeypatch.setenv(step_graph.VARIABLE, "1")
    captures = []
    real = step_graph.cuda_capture
    monkeypatch.setattr(step_graph, "cuda_capture", lambda graphed: captures.append(1) or real(graphed))
    with caplog.at_level(logging.WARNING, logger=step_graph.__name__):
        graphed, again = run(), run()
    assert not caplog.records, caplog.text
    assert len(captures) == 2, "one capture a run: the graphs go with their run"
    return plain, graphed, again
