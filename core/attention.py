"""The attention kernel of the pack's transformer forwards, chosen by measurement on each card.

The first attention call of a kind (``self``, or ``cross`` over the caption; with a mask or without; in
one dtype) on a GPU times each candidate on that call's own tensors — torch's SDPA backends (cuDNN,
FlashAttention, memory-efficient) and flash-attn-4 where it is installed — checks its output against an
exact reference (:func:`tolerance`), and keeps the fastest that passes for every later call of that kind
on a card of that name, whatever its shape. One log line says which runs and why the others were passed
over. A cross-attention without a mask has keys as long as its prompt (ComfyUI's unpadded conditioning, a
new length for nearly every prompt): there each candidate is also timed on a key length it has not met,
and what that costs it counts once in :data:`CALLS_PER_KEY_LENGTH` calls (cuDNN builds an execution plan
for each new shape, 37-67 ms at PixArt-Σ's; FlashAttention none).

``PIXART_LOWVRAM_ATTENTION`` (:data:`ENV`) forces one backend. On the CPU nothing is measured: every call
is torch's own ``scaled_dot_product_attention``.

:class:`Processor` is the diffusers attention processor both doors use (the sampler stage's
transformer and the int8 MODEL's diffusers blocks); :func:`settle` makes the choices before a compiled
run, whose traced calls cannot be timed; :func:`measure` gives benchmarks every candidate's figures."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger(__name__)

KINDS = ("self", "cross")
ENV = "PIXART_LOWVRAM_ATTENTION"
SDPA = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
FA4 = "fa4"
# What the measurement weighs, in this order (the order breaks near ties, see MARGIN). The math backend
# is never the fastest where another runs, and holds the whole score matrix (1 GiB at 1024² with
# guidance): only forced or measured for a table.
AUTO = ("cudnn", "flash", "efficient", FA4)
CHOICES = ("auto", *SDPA, FA4)
# A candidate within this fraction of the fastest one's time that comes earlier in AUTO's order is kept
# instead: two backends a timing's noise apart would otherwise swap between processes, and with them the
# last bits of every image.
MARGIN = 0.05
# The calls over which a new key length's cost is spread: one forward's worth a step (28 blocks) over 20
# steps, what one prompt (or its negative) of one length costs under KSampler.
CALLS_PER_KEY_LENGTH = 28 * 20
WARM_UP, RUNS = 2, 5
# The output is checked on a slice: the last batch item, the first and last heads, every n-th query up to
# this many (attention is independent per item, head and query; the exact reference of the whole call
# would hold its fp64 score matrix).
CHECKED_QUERIES = 256


@dataclass(frozen=True)
class Candidate:
    """A way to compute ``scaled_dot_product_attention(q, k, v, attn_mask=mask)`` (``[batch, heads, tokens,
    head size]``), or, with ``reason``, one that cannot run this call and why."""

    name: str
    run: Callable | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Result:
    """One candidate measured on one call: ``seconds`` a call, ``per_key_length`` the extra seconds of its
    first call at a new key length (a cross-attention without a mask), ``error`` its largest difference
    from the exact reference, which must stay within ``tolerance``; ``reason``: why it did not run."""

    name: str
    seconds: float | None = None
    per_key_length: float | None = None
    error: float | None = None
    tolerance: float | None = None
    reason: str | None = None

    @property
    def passed(self) -> bool:
        return self.reason is None and self.error is not None and self.error <= self.tolerance

    @property
    def cost(self) -> float:
        """Seconds a call, a new key length's cost spread over :data:`CALLS_PER_KEY_LENGTH` calls."""
        return self.seconds + (self.per_key_length or 0.0) / CALLS_PER_KEY_LENGTH

    def describe(self) -> str:
        if self.reason is not None:
            return f"{self.name} {self.reason}"
        text = f"{self.name} {self.seconds * 1e6:.0f} us"
        if self.per_key_length is not None:
            text += f" + {self.per_key_length * 1e3:.1f} ms a new key length"
        if not self.passed:
            text += f", off by {self.error:.1e} (tolerance {self.tolerance:.1e})"
        return text


def forced() -> str | None:
    """The backend ``PIXART_LOWVRAM_ATTENTION`` names, None for ``auto`` or unset."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r} is not an attention backend; set it to one of {', '.join(CHOICES)} "
            "(auto: the fastest measured), or unset it."
        )
    return None if value == "auto" else value


def tolerance(dtype: torch.dtype, v: torch.Tensor) -> float:
    """How far an attention output in ``dtype`` may be from the exact one: 4 u × max|v| (u: the dtype's unit
    roundoff, 2^-11 for fp16).

    The output is a convex combination of v's rows, so each error below is bounded by max|v|. A kernel
    computes the scores and their softmax in fp32 and rounds twice in the dtype: the probabilities, for the
    product with v (≤ u max|v|), and the output (≤ u max|v|); fp32's own rounding is 2^13 times finer. So
    2 u max|v|, doubled for accumulation order and exp approximations. On the CPU (torch 2.13) fp16 and
    bf16 kernels stay within 0.7 u max|v|; a kernel reading the wrong head, token or scale is off by a
    sizeable part of max|v|."""
    return 4 * (torch.finfo(dtype).eps / 2) * v.abs().max().item()


def _sdpa(backend: SDPBackend) -> Callable:
    def run(q, k, v, mask=None):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


# One function a backend for the life of the process: a compiled graph guards on the one it traced.
SDPA_RUNS = {name: _sdpa(backend) for name, backend in SDPA.items()}


def torch_default(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


TORCH_DEFAULT = Candidate("torch's own choice", torch_default)


@functools.cache
def _flash_attn_func() -> tuple[Callable | None, str | None]:
    """flash-attn-4's ``flash_attn_func``, or why it cannot be imported."""
    try:
        from flash_attn.cute import flash_attn_func
    except ModuleNotFoundError:
        return None, "not installed (pip install flash-attn-4)"
    except Exception as exc:  # an install that fails to import (its CUDA libraries, its DSL)
        return None, f"fails to import ({_first_line(exc)})"
    return flash_attn_func, None


def _fa4_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # flash-attn-4 takes [batch, tokens, heads, head size]: the diffusers processor's own layout before
    # its transpose, so these are views.
    out = _flash_attn_func()[0](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


# flash-attn-4 as a torch operator, which a compiled graph holds as one call (dynamo cannot trace its
# kernels' Python): registered once a process, with the first candidate made of it, before any tracing.
_fa4_operator = None


def _register_fa4_operator():
    # torch.library.Library rather than custom_op: no custom_op wrapper on each call.
    library = torch.library.Library("pixart_lowvram", "FRAGMENT")
    library.define("flash_attn_4(Tensor q, Tensor k, Tensor v) -> Tensor")
    library.impl("flash_attn_4", _fa4_eager, "CompositeExplicitAutograd")

    @torch.library.register_fake("pixart_lowvram::flash_attn_4", lib=library)
    def _(q, k, v):
        batch, heads, tokens, size = q.shape
        return q.new_empty(batch, tokens, heads, size).transpose(1, 2)

    _fa4_libraries.append(library)  # the registration lasts as long as its Library object
    return torch.ops.pixart_lowvram.flash_attn_4.default


_fa4_libraries: list = []


def _fa4_run(q, k, v, mask=None):
    return _fa4_operator(q, k, v) if torch.compiler.is_compiling() else _fa4_eager(q, k, v)


def _flash_attn_4() -> tuple[Callable | None, str | None]:
    """flash-attn-4's attention in torch's layout (``[batch, heads, tokens, head size]``), or why not."""
    global _fa4_operator
    func, reason = _flash_attn_func()
    if func is None:
        return None, reason
    if _fa4_operator is None:
        _fa4_operator = _register_fa4_operator()
    return _fa4_run, None


def _fa4(q: torch.Tensor, mask) -> Candidate:
    if mask is not None:
        return Candidate(FA4, reason="takes no mask")
    if q.dtype not in (torch.float16, torch.bfloat16):
        return Candidate(FA4, reason=f"takes fp16 or bf16, not {q.dtype}")
    if q.device.type != "cuda" or torch.version.hip is not None:
        return Candidate(FA4, reason="runs on NVIDIA GPUs only")
    major, minor = torch.cuda.get_device_capability(q.device)
    if major not in (9, 10, 11):
        return Candidate(FA4, reason=f"needs compute capability 9.x to 11.x, not {major}.{minor}")
    run, reason = _flash_attn_4()
    return Candidate(FA4, run, reason)


def candidates(q: torch.Tensor, mask) -> list[Candidate]:
    """Every backend for a call like ``q``'s (with or without ``mask``): torch's SDPA backends (whether one
    runs shows when it is tried) and flash-attn-4, with the reason where it cannot."""
    return [*(Candidate(name, run) for name, run in SDPA_RUNS.items()), _fa4(q, mask)]


def cuda_timer(fn: Callable, warm_up: int, runs: int) -> float:
    """Seconds a call of ``fn`` takes on the clock: ``runs`` calls issued back to back, then waited for
    (``warm_up`` calls first). The longer of the GPU's time and the host's time to issue the calls, as a
    run sees them: a kernel that is fast on the GPU but slow to launch (flash-attn-4 from Python on an H100,
    2026-12-06: 365 µs on the GPU, a sampler run launch-bound) costs its launch."""
    for _ in range(warm_up):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / runs


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class Chooser:
    """Makes and keeps the choices (:meth:`choose`); ``candidates``, ``timer`` and ``device_name`` are
    :func:`candidates`, :func:`cuda_timer` and :func:`device_name` unless a test gives its own."""

    def __init__(self, candidates=candidates, timer=cuda_timer, device_name=device_name):
        self.candidates, self.timer, self.device_name = candidates, timer, device_name
        # The choices per card name, and the same per device (looked up at every call).
        self.by_name: dict[tuple, Candidate] = {}
        self.made: dict[tuple, Candidate] = {}

    def choose(self, kind: str, q, k, v, mask=None) -> Candidate:
        """The backend for attention of ``kind`` like this call on its device: measured at the first such
        call on a card of its name, kept for every later one."""
        key = (q.device, kind, mask is not None, q.dtype)
        chosen = self.made.get(key)
        if chosen is None:
            if kind not in KINDS:
                raise ValueError(f"attention kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
            named = (self.device_name(q.device), *key[1:])
            if named not in self.by_name:
                self.by_name[named] = self._decide(named, q, k, v, mask)
            chosen = self.made[key] = self.by_name[named]
        return chosen

    def evaluate(self, kind: str, q, k, v, mask, pool: list[Candidate]) -> list[Result]:
        """Each candidate of ``pool`` run on this call: its output checked, its time measured."""
        picked = _Slice(q)
        with sdpa_kernel(SDPBackend.MATH):
            exact = F.scaled_dot_product_attention(
                picked.queries(q).double(),
                picked.keys(k).double(),
                picked.keys(v).double(),
                attn_mask=picked.mask(mask),
            )
        bound = tolerance(q.dtype, picked.keys(v))
        longer = None
        if kind == "cross" and mask is None:
            longer = tuple(torch.cat([t, t[:, :, -1:]], dim=2) for t in (k, v))
        results = []
        for candidate in pool:
            if candidate.reason is not None:
                results.append(Result(candidate.name, reason=candidate.reason))
                continue
            try:
                results.append(self._measure(candidate, q, k, v, mask, picked, exact, bound, longer))
            except Exception as exc:  # a backend that cannot run this call; torch's warnings say why
                results.append(Result(candidate.name, reason=f"cannot run it ({_first_line(exc)})"))
        return results

    def _measure(self, candidate, q, k, v, mask, picked, exact, bound, longer) -> Result:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                out = candidate.run(q, k, v, mask)
            except RuntimeError as exc:
                told = [_first_line(w.message) for w in said]
                why = next((line for line in told if line and not line.endswith("because:")), None)
                if why:
                    raise RuntimeError(why) from exc
                raise
        error = (picked.queries(out).double() - exact).abs().max().item()
        with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
            seconds = self.timer(lambda: candidate.run(q, k, v, mask), WARM_UP, RUNS)
            per_key_length = None
            if longer is not None:
                first = self.timer(lambda: candidate.run(q, *longer), 0, 1)
                per_key_length = max(first - seconds, 0.0)
        return Result(candidate.name, seconds, per_key_length, error, bound)

    def _decide(self, named: tuple, q, k, v, mask) -> Candidate:
        name, kind, masked, dtype = named
        wanted = forced()
        found = {candidate.name: candidate for candidate in self.candidates(q, mask)}
        if wanted:
            pool = [found.get(wanted, Candidate(wanted, reason="is not a candidate here"))]
        else:
            pool = [found[each] for each in AUTO if each in found]
        results = self.evaluate(kind, q, k, v, mask, pool)
        passed = [result for result in results if result.passed]
        best = None
        if passed:
            fastest = min(result.cost for result in passed)
            best = next(result for result in passed if result.cost <= fastest * (1 + MARGIN))
        label = (
            f"attention ({kind}{' with mask' if masked else ''}, {name}, {str(dtype).removeprefix('torch.')})"
        )
        chosen = best.describe() if best else TORCH_DEFAULT.name
        if best and best.cost > fastest:
            chosen += f" (within {MARGIN:.0%} of the fastest, and first in order)"
        others = ", ".join(result.describe() for result in results if result is not best)
        if wanted:
            others += f" (forced by {ENV})" if others else ""
            chosen += "" if others else f", forced by {ENV}"
        logger.log(
            logging.INFO if best else logging.WARNING,
            "%s: %s%s",
            label,
            chosen,
            f"; passed over: {others}" if others else "",
        )
        return found[best.name] if best else TORCH_DEFAULT


class _Slice:
    """The part of a call the output check computes exactly (see :data:`CHECKED_QUERIES`)."""

    def __init__(self, q: torch.Tensor):
        batch, heads, tokens, _ = q.shape
        self.shape = (batch, heads, tokens)
        self.heads = sorted({0, heads - 1})
        self.step = max(1, tokens // CHECKED_QUERIES)

    def keys(self, t: torch.Tensor) -> torch.Tensor:
        return t[-1:, self.heads]

    def queries(self, t: torch.Tensor) -> torch.Tensor:
        return self.keys(t)[:, :, :: self.step]

    def mask(self, mask):
        if mask is None:
            return None
        whole = mask.expand(*self.shape, mask.shape[-1])
        picked = self.queries(whole)
        return picked if picked.dtype == torch.bool else picked.double()


def _first_line(text) -> str:
    lines = str(text).strip().splitlines()
    return lines[0].split(" (Triggered internally")[0] if lines else ""


CHOOSER = Chooser()


def attend(kind: str, q, k, v, mask=None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, attn_mask=mask)`` on the backend chosen for ``kind``
    (:meth:`Chooser.choose`); torch's own where nothing is measured (the CPU, and a compiled graph
    traced before its kind's choice, see :func:`settle`)."""
    chosen = CHOOSER.made.get((q.device, kind, mask is not None, q.dtype))
    if chosen is None:
        if q.device.type != "cuda" or torch.compiler.is_compiling():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        chosen = CHOOSER.choose(kind, q, k, v, mask)
    return chosen.run(q, k, v, mask)


def inputs(
    batch: int,
    heads: int,
    queries: int,
    keys: int,
    head_dim: int,
    masked: bool = False,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.float16,
) -> tuple:
    """Random q, k, v (``[batch, heads, tokens, head_dim]``) and, ``masked``, an additive mask hiding the
    second half of the keys, shaped as diffusers' processors pass a caption's mask."""
    q = torch.randn(batch, heads, queries, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, heads, keys, head_dim, device=device, dtype=dtype) for _ in range(2))
    mask = None
    if masked:
        mask = torch.zeros(batch, heads, 1, keys, device=device, dtype=dtype)
        mask[..., max(1, keys // 2) :] = -10000.0
    return q, k, v, mask


@torch.no_grad()
def settle(
    device: torch.device, dtype: torch.dtype, batch, heads, head_dim, queries, keys, masked: bool = True
) -> None:
    """The self-attention's and the cross-attention's (``masked``: with a mask, as the sampler's padded
    caption has) choices on ``device``, made on random tensors of a run's shapes before its compiled
    forward traces them; nothing where they are made already, nothing on the CPU."""
    if device.type != "cuda":
        return
    if device.index is None:  # with its index, as the tensors' device has it
        device = torch.device(device.type, torch.cuda.current_device())
    for kind, mask_kind in (("self", False), ("cross", masked)):
        if (device, kind, mask_kind, dtype) in CHOOSER.made:
            continue
        width = queries if kind == "self" else keys
        CHOOSER.choose(kind, *inputs(batch, heads, queries, width, head_dim, mask_kind, device, dtype))


@torch.no_grad()
def measure(
    kind: str,
    batch: int,
    heads: int,
    queries: int,
    keys: int,
    head_dim: int,
    masked: bool = False,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.float16,
) -> list[Result]:
    """Every candidate (the math backend included, whatever ``PIXART_LOWVRAM_ATTENTION`` says) measured as
    a first call would measure it, on random tensors of these shapes; no choice is kept. For a table::

        for r in attention.measure("self", 2, 16, 4096, 4096, 72):
            print(r.name, r.seconds, r.per_key_length, r.passed, r.reason)
    """
    if kind not in KINDS:
        raise ValueError(f"attention kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    q, k, v, mask = inputs(batch, heads, queries, keys, head_dim, masked, device, dtype)
    return CHOOSER.evaluate(kind, q, k, v, mask, CHOOSER.candidates(q, mask))


def attend_heads(attn, kind: str, query, key, value, mask=None) -> torch.Tensor:
    """``AttnProcessor2_0``'s attention of the projected ``query``, ``key`` and ``value`` (``[batch, tokens,
    heads × head size]``) of diffusers' ``Attention`` module ``attn``, with its mask prepared as that
    processor prepares it, through :func:`attend`; the result in the query's layout and dtype."""
    batch, heads = query.shape[0], attn.heads
    if mask is not None:
        mask = attn.prepare_attention_mask(mask, key.shape[1], batch)
        mask = mask.view(batch, heads, -1, mask.shape[-1])
    q, k, v = (t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (query, key, value))
    out = attend(kind, q, k, v, mask)
    return out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1]).to(query.dtype)


def unsupported(module) -> str | None:
    """What diffusers ``Attention`` ``module`` does that :func:`attend_heads` leaves out (norms, a residual,
    a rescaled output: none of them in PixArt-Σ); None if nothing."""
    used = [each for each in UNSUPPORTED if getattr(module, each, None) is not None]
    if used or module.residual_connection or module.rescale_output_factor != 1.0:
        return str(used) if used else "a residual or rescaled output"
    return None


class Processor:
    """diffusers' attention processor for PixArt-Σ's blocks (``AttnProcessor2_0``'s steps, or
    ``FusedAttnProcessor2_0``'s where the module holds fused ``to_qkv``/``to_kv`` projections), whose
    attention runs through :func:`attend`: ``self`` without encoder states, ``cross`` with them.

    diffusers' ``Attention.forward`` asks for its processor's signature at every call
    (``inspect.signature``, about 20 µs on a CPU core; 56 calls a step); this one's is computed once."""

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kwargs
    ):
        if encoder_hidden_states is None:
            kind = "self"
            if hasattr(attn, "to_qkv"):
                query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
            else:
                query, key, value = (
                    attn.to_q(hidden_states),
                    attn.to_k(hidden_states),
                    attn.to_v(hidden_states),
                )
        else:
            kind = "cross"
            query = attn.to_q(hidden_states)
            if hasattr(attn, "to_kv"):
                key, value = attn.to_kv(encoder_hidden_states).chunk(2, dim=-1)
            else:
                key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        out = attend_heads(attn, kind, query, key, value, attention_mask)
        return attn.to_out[1](attn.to_out[0](out))


Processor.__call__.__signature__ = inspect.signature(Processor.__call__)

# What diffusers' Attention may hold that Processor leaves out: none of them is set in PixArt-Σ.
UNSUPPORTED = ("spatial_norm", "group_norm", "norm_q", "norm_k", "norm_cross")


def install(model: torch.nn.Module) -> None:
    """Every diffusers ``Attention`` module of ``model`` runs :class:`Processor`."""
    from diffusers.models.attention_processor import Attention

    processor = Processor()
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        what = unsupported(module)
        if what is not None:
            raise ValueError(f"attention {name or type(module).__name__} uses {what}: not PixArt-Σ's")
        module.set_processor(processor)
