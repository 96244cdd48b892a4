"""A CUDA graph's capture on the CPU, for the tests of core/step_graph.py's graphs (the sampler's and the
int8 MODEL's): it keeps a graph's contract. The captured call's output tensors are the ones every replay
fills, computed from the captured inputs' tensors; so a call whose inputs were not copied in, or whose output
is the graph's own buffer, gives wrong numbers here as on a GPU."""

from __future__ import annotations

from torch.utils import _pytree as pytree


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
