"""The transformer's forward replayed from a CUDA graph per input signature for a compiled run
(core/step_graph.py), on the CPU with a stand-in capture that keeps a graph's contract
(tests/graph_stand_in.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from graph_stand_in import StandIn

from pixart_lowvram.core import sampler, sampler_settings, step_graph

FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}


class Forward(torch.nn.Module):
    """A forward shaped like the transformer's: a tensor, keyword tensors, a dict with None in it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
        self.calls = 0

    def forward(
        self, hidden, encoder_hidden_states=None, timestep=None, added_cond_kwargs=None, return_dict=True
    ):
        self.calls += 1
        assert added_cond_kwargs == {"resolution": None}
        out = hidden @ self.weight + encoder_hidden_states.mean() * timestep[:, None]
        return (out,) if not return_dict else {"sample": out}


def call(forward, seed: int, rows: int = 4):
    g = torch.Generator().manual_seed(seed)
    return forward(
        torch.randn(rows, 8, generator=g),
        encoder_hidden_states=torch.randn(rows, 3, 8, generator=g),
        timestep=torch.rand(rows, generator=g) * 1000,
        added_cond_kwargs={"resolution": None},
        return_dict=False,
    )[0]


def test_first_call_runs_second_captures_later_ones_replay_with_their_own_inputs():
    module, capture = Forward(), StandIn()
    graphs = step_graph.Graphed(module.forward, capture)
    outputs = [call(graphs, seed) for seed in range(5)]
    assert (capture.captures, capture.replays) == (1, 4)  # the second call is captured, then replayed
    assert module.calls == 1 + 1 + 4  # eager; captured; each replay computes once more here
    for seed, output in enumerate(outputs):
        assert torch.equal(output, call(module, seed)), f"call {seed}: not its own inputs' output"
    assert outputs[2].data_ptr() != outputs[3].data_ptr(), "each call returns its own copy, not the graph's"


def test_a_new_shape_or_argument_is_a_graph_of_its_own():
    module, capture = Forward(), StandIn()
    graphs = step_graph.Graphed(module.forward, capture)
    for seed in range(3):
        call(graphs, seed)
        call(graphs, seed, rows=2)
    assert capture.captures == 2 and len(graphs.graphs) == 2
    expected = call(module, 7, rows=2)
    assert torch.equal(call(graphs, 7, rows=2), expected)
    graphs(torch.zeros(4, 8), encoder_hidden_states=torch.zeros(4, 3, 8), timestep=torch.zeros(4),
           added_cond_kwargs={"resolution": None}, return_dict=True)  # fmt: skip
    assert capture.captures == 2, "another return_dict is another signature: first run as it is"


def test_a_failed_capture_is_logged_once_and_the_calls_run_as_before(caplog):
    module, capture = (
        Forward(),
        StandIn(fail=RuntimeError("operation not permitted when stream is capturing")),
    )
    graphs = step_graph.Graphed(module.forward, capture)
    with caplog.at_level(logging.WARNING, logger="pixart_lowvram.core.step_graph"):
        outputs = [call(graphs, seed) for seed in range(4)]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "could not be captured" in lines[0] and "not permitted" in lines[0]
    for seed, output in enumerate(outputs):
        assert torch.equal(output, call(module, seed))
    assert not graphs.graphs


def test_the_run_restores_the_forward_and_drops_its_graphs(monkeypatch):
    capture = StandIn()
    monkeypatch.setattr(step_graph, "cuda_capture", capture)
    module = Forward()
    with step_graph.graphed(module, enabled=True) as graphs:
        for seed in range(3):
            call(module, seed)
        assert capture.replays == 2 and graphs.graphs
    assert "forward" not in vars(module) and not graphs.graphs
    with step_graph.graphed(module, enabled=False) as nothing:
        assert nothing is None and "forward" not in vars(module)
    with pytest.raises(ValueError), step_graph.graphed(module, enabled=True):
        raise ValueError("a failed step")
    assert "forward" not in vars(module)


@pytest.mark.parametrize(
    ("value", "device", "compiled", "streamed", "step_cache", "expected"),
    [
        ("1", "cuda", True, False, 0.0, True),
        ("", "cuda", True, False, 0.0, False),
        ("0", "cuda", True, False, 0.0, False),
        ("1", "cpu", True, False, 0.0, False),
        ("1", "cuda", False, False, 0.0, False),
        ("1", "cuda", True, True, 0.0, False),
        ("1", "cuda", True, False, 0.1, False),
    ],
)
def test_which_runs_are_graphed(monkeypatch, value, device, compiled, streamed, step_cache, expected):
    monkeypatch.setenv(step_graph.VARIABLE, value)
    assert step_graph.wanted(device, compiled, streamed, step_cache) is expected


def test_a_bad_setting_names_the_variable_and_its_values(monkeypatch):
    monkeypatch.setenv(step_graph.VARIABLE, "yes")
    with pytest.raises(
        ValueError,
        match=r"PIXART_LOWVRAM_CUDA_GRAPH='yes'.*1 \(a CUDA graph a step\) or 0 \(none, the default\)",
    ):
        step_graph.wanted("cuda", True, False, 0.0)


def test_a_graphed_sampler_run_gives_the_run_s_bits(tiny, reference, monkeypatch):
    """The sampler's run with its forward graphed (the stand-in capture) gives the same latents as without:
    the same computation on the same inputs, each step's copied into the graph's."""
    settings = sampler_settings.SamplerSettings(tiny, width=64, height=64, steps=6, seed=5, cfg=4.5, **FP32)
    plain = sampler.sample(settings, reference.embeds)
    capture = StandIn()
    monkeypatch.setattr(step_graph, "cuda_capture", capture)
    monkeypatch.setattr(step_graph, "wanted", lambda *args: True)
    graphed = sampler.sample(settings, reference.embeds)
    assert (capture.captures, capture.replays) == (1, 6 - 1)  # the first step runs as it is
    assert torch.equal(graphed, plain)
