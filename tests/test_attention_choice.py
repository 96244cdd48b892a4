"""The attention backend chosen by measurement (core/attention.py): the chooser with its candidates and
timer given by the test picks the fastest whose output passes the check, once per kind and card; the
forcing variable; both doors run every attention call through it; on the CPU nothing is measured. The GPU
test holds every backend the card runs to SDPA's own output."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import FP32
from torch.nn.attention import SDPBackend

from pixart_lowvram.core import attention, sampler, sampler_settings

DTYPE = torch.float16


def tensors(keys: int = 16, queries: int = 16, masked: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    return attention.inputs(2, 4, queries, keys, 8, masked, "cpu", DTYPE)


def exact(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def one_rounding(q, k, v, mask=None):
    """SDPA's output moved by one unit roundoff of max|v| in alternating directions: within fp16's
    tolerance."""
    out = exact(q, k, v, mask)
    signs = torch.ones_like(out).flatten()
    signs[1::2] = -1
    step = torch.finfo(DTYPE).eps / 2 * v.abs().max()
    return out + (signs.view_as(out) * step).to(out.dtype)


def wrong_heads(q, k, v, mask=None):
    return exact(q, k, v, mask).flip(1)


class Card:
    """Candidates whose runs say who ran, a timer that reads the times from a table (and the first call
    at a new key length from another), and a card name."""

    def __init__(self, runs: dict, times: dict, first_times: dict | None = None, name: str = "Test GPU"):
        self.runs, self.times, self.first_times, self.name = runs, times, first_times or {}, name
        self.ran: list[str] = []
        self.timed: list[tuple[str, int]] = []  # (candidate, its key length)

    def candidates(self, _q, _mask):
        found = []
        for name in (*attention.AUTO, "math"):
            if name in self.runs:
                found.append(attention.Candidate(name, self._recording(name, self.runs[name])))
            else:
                found.append(attention.Candidate(name, reason="not installed (pip install flash-attn-4)"))
        return found

    def _recording(self, name, run):
        def recorded(q, k, v, mask=None):
            self.ran.append((name, k.shape[-2]))
            return run(q, k, v, mask)

        return recorded

    def timer(self, fn, warm_up: int, runs: int) -> float:
        fn()
        name, keys = self.ran[-1]
        self.timed.append((name, keys))
        if warm_up == 0 and runs == 1:  # a first call (at a new key length)
            return self.first_times.get(name, self.times[name])
        return self.times[name]

    def chooser(self) -> attention.Chooser:
        return attention.Chooser(self.candidates, self.timer, lambda _device: self.name)


@pytest.fixture(autouse=True)
def auto(monkeypatch):
    monkeypatch.delenv(attention.ENV, raising=False)


def test_the_fastest_that_passes_is_chosen_and_the_others_named(caplog):
    card = Card(
        {"cudnn": wrong_heads, "flash": one_rounding, "efficient": exact},
        {"cudnn": 300e-6, "flash": 400e-6, "efficient": 900e-6},
    )
    q, k, v, _ = tensors()
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        chosen = card.chooser().choose("self", q, k, v)
    assert chosen.name == "flash"
    assert torch.equal(chosen.run(q, k, v), one_rounding(q, k, v))
    line = caplog.messages[-1]
    assert line.startswith(
        "attention (self, Test GPU, float16): flash 400 us; passed over: cudnn 300 us, off by "
    )
    assert line.endswith(", efficient 900 us, fa4 not installed (pip install flash-attn-4)")
    # The wrong one is off by a sizeable part of max|v|; one rounding passed within the derived bound.
    results = {r.name: r for r in card.chooser().evaluate("self", q, k, v, None, card.candidates(q, None))}
    assert results["cudnn"].error > 10 * results["cudnn"].tolerance
    assert 0 < results["flash"].error <= results["flash"].tolerance


def test_a_backend_that_cannot_run_the_call_is_passed_over_with_torchs_reason(caplog):
    """The real SDPA candidates on the CPU: cuDNN and memory-efficient attention run on GPUs only."""
    q, k, v, _ = tensors()

    def timer(fn, _warm_up, _runs):
        fn()
        return 1e-4

    chooser = attention.Chooser(timer=timer, device_name=lambda _device: "CPU")
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        chosen = chooser.choose("self", q, k, v)
    assert chosen.name == "flash"
    assert "cudnn cannot run it (" in caplog.messages[-1]
    assert "fa4 runs on NVIDIA GPUs only" in caplog.messages[-1]


def test_near_ties_go_to_the_earlier_backend(caplog):
    """A timing's noise apart, the order decides (the same kernel, so the same image, in every process)."""
    card = Card({"cudnn": exact, "flash": exact}, {"cudnn": 452e-6, "flash": 440e-6})
    q, k, v, _ = tensors()
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        assert card.chooser().choose("self", q, k, v).name == "cudnn"
    assert (
        "cudnn 452 us (within 5% of the fastest, and first in order); passed over: flash 440 us"
        in (caplog.messages[-1])
    )
    card = Card({"cudnn": exact, "flash": exact}, {"cudnn": 480e-6, "flash": 440e-6})
    assert card.chooser().choose("self", q, k, v).name == "flash"


def test_the_choice_is_made_once_per_kind_and_card_not_per_shape():
    card = Card({"cudnn": exact, "flash": exact}, {"cudnn": 1e-4, "flash": 2e-4})
    chooser = card.chooser()
    chooser.choose("self", *tensors(keys=16, queries=16)[:3])
    measured = len(card.timed)
    chooser.choose("self", *tensors(keys=64, queries=64)[:3])  # another image size
    assert len(card.timed) == measured
    q, k, v, mask = tensors(keys=12, masked=True)
    chooser.choose("cross", q, k, v, mask)
    assert len(card.timed) > measured
    measured = len(card.timed)
    chooser.choose("cross", *tensors(keys=20, masked=True))
    assert len(card.timed) == measured
    chooser.choose("cross", *tensors(keys=20)[:3])  # without a mask: another kind of call
    assert len(card.timed) > measured
    # Another device of the same name takes the choice as it is; one of another name measures.
    measured = len(card.timed)
    chooser.made.clear()
    chooser.choose("self", *tensors()[:3])
    assert len(card.timed) == measured
    chooser.made.clear()
    card.name = "Other GPU"
    chooser.choose("self", *tensors()[:3])
    assert len(card.timed) > measured
    with pytest.raises(ValueError, match="attention kind 'joint' is unknown; use one of self, cross"):
        chooser.choose("joint", *tensors()[:3])


def test_a_cross_attention_over_unpadded_keys_counts_a_new_key_lengths_cost(caplog):
    """cuDNN's faster call loses to FlashAttention where each new prompt length costs it a plan."""
    times = {"cudnn": 62e-6, "flash": 73e-6}
    card = Card({"cudnn": exact, "flash": exact}, times, first_times={"cudnn": 41e-3, "flash": 120e-6})
    q, k, v, _ = tensors(keys=12)
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        assert card.chooser().choose("cross", q, k, v).name == "flash"
    assert (
        "attention (cross, Test GPU, float16): flash 73 us + 0.0 ms a new key length; passed over: "
        "cudnn 62 us + 40.9 ms a new key length" in caplog.messages[-1]
    )
    assert ("cudnn", 13) in card.timed  # timed at a key length it had not met
    # With a mask the keys are padded to one length (the sampler's 300): the call's own time decides.
    card = Card({"cudnn": exact, "flash": exact}, times, first_times={"cudnn": 41e-3})
    q, k, v, mask = tensors(keys=12, masked=True)
    assert card.chooser().choose("cross", q, k, v, mask).name == "cudnn"
    assert all(keys == 12 for _name, keys in card.timed)


def test_the_variable_forces_a_backend(monkeypatch, caplog):
    card = Card({"cudnn": exact, "efficient": exact}, {"cudnn": 1e-4, "efficient": 9e-4})
    q, k, v, _ = tensors()
    monkeypatch.setenv(attention.ENV, " Efficient ")
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        assert card.chooser().choose("self", q, k, v).name == "efficient"
    assert caplog.messages[-1] == (
        f"attention (self, Test GPU, float16): efficient 900 us, forced by {attention.ENV}"
    )
    assert {name for name, _keys in card.timed} == {"efficient"}
    # One the call cannot take: torch's own choice, and the line says why.
    monkeypatch.setenv(attention.ENV, "fa4")
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        assert card.chooser().choose("self", q, k, v) is attention.TORCH_DEFAULT
    assert caplog.records[-1].levelname == "WARNING"
    assert caplog.messages[-1] == (
        "attention (self, Test GPU, float16): torch's own choice; passed over: fa4 not installed "
        f"(pip install flash-attn-4) (forced by {attention.ENV})"
    )


def test_a_bad_value_of_the_variable_names_it_and_the_choices(monkeypatch):
    monkeypatch.setenv(attention.ENV, "sage")
    message = (
        f"{attention.ENV}='sage' is not an attention backend; set it to one of auto, cudnn, flash, "
        "efficient, math, fa4 (auto: the fastest measured), or unset it."
    )
    with pytest.raises(ValueError) as caught:
        Card({"flash": exact}, {"flash": 1e-4}).chooser().choose("self", *tensors()[:3])
    assert str(caught.value) == message
    monkeypatch.setenv(attention.ENV, "AUTO")
    assert attention.forced() is None


def test_on_the_cpu_nothing_is_measured(monkeypatch):
    chooser = attention.Chooser(timer=lambda *_: pytest.fail("the CPU measured"))
    monkeypatch.setattr(attention, "CHOOSER", chooser)
    q, k, v, mask = tensors(keys=12, masked=True)
    assert torch.equal(attention.attend("cross", q, k, v, mask), exact(q, k, v, mask))
    assert chooser.made == {} and chooser.by_name == {}
    attention.settle(torch.device("cpu"), DTYPE, 2, 4, 8, 16, 12)
    assert chooser.made == {}


def test_a_compiled_call_runs_the_choice_made_before_it_traced(monkeypatch):
    """torch.compile traces the chosen backend's context into its one graph; before any choice, torch's own
    SDPA (no context)."""
    chooser = attention.Chooser()
    monkeypatch.setattr(attention, "CHOOSER", chooser)
    q, k, v, _ = tensors()
    graphs = []

    def backend(graph, _inputs):
        graphs.append({node.target for node in graph.graph.nodes})
        return graph.forward

    def step(q, k, v):
        return attention.attend("self", q, k, v) * 2

    chooser.made[(q.device, "self", False, q.dtype)] = attention.Candidate(
        "flash", attention.SDPA_RUNS["flash"]
    )
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend=backend, fullgraph=True)(q, k, v), exact(q, k, v) * 2)
    chooser.made.clear()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend=backend, fullgraph=True)(q, k, v), exact(q, k, v) * 2)
    torch._dynamo.reset()
    entered = [torch.nn.attention._sdpa_kernel in targets for targets in graphs]
    assert entered == [True, False]


@pytest.fixture
def fake_flash_attn_4(monkeypatch):
    """flash-attn-4's module as it imports (``flash_attn.cute.flash_attn_func``: [batch, tokens, heads,
    head size] in, ``(out, lse)`` out), computing with torch's SDPA."""

    def flash_attn_func(q, k, v):
        out = exact(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        return out.contiguous(), None

    package = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    attention._flash_attn_func.cache_clear()
    yield
    attention._flash_attn_func.cache_clear()


def test_flash_attn_4_runs_in_torchs_layout_eager_and_compiled(fake_flash_attn_4):
    q, k, v, _ = tensors(keys=12)
    run, reason = attention._flash_attn_4()
    assert reason is None
    assert torch.equal(run(q, k, v), exact(q, k, v))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: run(q, k, v) + 1, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), exact(q, k, v) + 1)


def test_flash_attn_4_only_where_it_can_run(monkeypatch):
    q, _k, _v, mask = tensors(keys=12, masked=True)
    assert attention._fa4(q, mask).reason == "takes no mask"
    assert attention._fa4(q.float(), None).reason == "takes fp16 or bf16, not torch.float32"
    assert attention._fa4(q, None).reason == "runs on NVIDIA GPUs only"
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    attention._flash_attn_func.cache_clear()
    try:
        assert attention._flash_attn_4() == (None, "not installed (pip install flash-attn-4)")
    finally:
        attention._flash_attn_func.cache_clear()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("cross", [False, True])
def test_the_processor_computes_diffusers_own_processors_numbers(fused, cross):
    """Bit for bit diffusers' AttnProcessor2_0 (FusedAttnProcessor2_0 on fused projections) on the CPU,
    with a caption mask on the cross-attention."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0, FusedAttnProcessor2_0

    torch.manual_seed(0)
    module = Attention(query_dim=32, heads=4, dim_head=8, cross_attention_dim=24 if cross else None)
    if fused:
        module.fuse_projections()
    hidden = torch.randn(2, 16, 32)
    caption = torch.randn(2, 6, 24) if cross else None
    mask = torch.tensor([[0.0] * 6, [0.0] * 3 + [-10000.0] * 3]).unsqueeze(1) if cross else None
    module.set_processor(FusedAttnProcessor2_0() if fused else AttnProcessor2_0())
    expected = module(hidden, caption, mask)
    attention.install(module)
    assert isinstance(module.processor, attention.Processor)
    assert torch.equal(module(hidden, caption, mask), expected)


def test_a_module_the_processor_does_not_cover_is_refused():
    from diffusers.models.attention_processor import Attention

    with pytest.raises(ValueError, match=r"attention Attention uses \['group_norm'\]: not PixArt-Σ's"):
        attention.install(Attention(query_dim=32, heads=4, dim_head=8, norm_num_groups=4))


def test_the_pack_sampler_runs_every_attention_through_the_choice(tiny, reference, monkeypatch):
    """Every attention call of the Quanto PixArt Sampler's transformer goes through attention.attend, as
    self or cross (with the caption's mask), and on the CPU the latents are the same bits as before."""
    seen = []
    attend = attention.attend

    def recording(kind, q, k, v, mask=None):
        seen.append((kind, mask is not None, k.shape[-2]))
        return attend(kind, q, k, v, mask)

    monkeypatch.setattr(attention, "attend", recording)
    settings = sampler_settings.SamplerSettings(tiny, **reference.settings, **FP32)
    latents = sampler.sample(settings, reference.embeds)
    kinds = {each[:2] for each in seen}
    assert kinds == {("self", False), ("cross", True)}
    assert {keys for kind, _masked, keys in seen if kind == "cross"} == {300}
    assert torch.equal(latents, reference.latents)


# The GPU tier: every backend the card runs, at a small PixArt-like shape (512²: 1024 patches, 16 heads of
# 72, the guidance batch of 2), against SDPA's own output.
GPU_CALLS = {
    "self": (2, 16, 1024, 1024, 72, False),
    "cross with mask": (2, 16, 1024, 300, 72, True),
    "cross": (2, 16, 1024, 120, 72, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("call", list(GPU_CALLS))
def test_every_backend_the_card_runs_is_within_tolerance_of_sdpas(call, dtype):
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA; run it on the GPU machine (pytest -m gpu)")
    torch.manual_seed(0)
    q, k, v, mask = attention.inputs(*GPU_CALLS[call], device="cuda", dtype=dtype)
    with torch.no_grad():
        default = exact(q, k, v, mask)
        bound = attention.tolerance(dtype, v)
        with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):
            truth = exact(q.double(), k.double(), v.double(), None if mask is None else mask.double())
        assert (default.double() - truth).abs().max().item() <= bound
        ran = []
        for candidate in attention.candidates(q, mask):
            if candidate.reason is not None:
                continue
            try:
                out = candidate.run(q, k, v, mask)
            except RuntimeError:  # a backend this card or call does not take
                continue
            ran.append(candidate.name)
            error = (out.double() - default.double()).abs().max().item()
            assert error <= 2 * bound, f"{candidate.name} is {error:.2e} from SDPA's output"
    assert ran, "no backend ran"
    kind = call.split()[0]
    results = attention.measure(kind, *GPU_CALLS[call], device="cuda", dtype=dtype)
    assert {r.name for r in results if r.reason is None} >= set(ran)
    assert all(r.passed for r in results if r.reason is None)
