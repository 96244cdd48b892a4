"""The models a stage uses: kept loaded between runs when a node asks for it (``keep_loaded``), and
otherwise waiting in host memory for the next run.

After a stage that does not keep its model, the model leaves the device — moved whole into CPU memory,
quantized as it is — and waits in a pool bounded by a byte budget (``host_budget``, default 4 GiB,
``$PIXART_LOWVRAM_HOST_POOL_GIB`` to change, 0 to turn the pool off), the least recently used leaving
first. The next run with the same settings moves it back instead of reading and quantizing it again. A
failed stage never leaves its model behind; :meth:`ModelCache.clear` and :func:`free_all` drop everything.

Beside the models, the cache remembers a few small results of them (:meth:`ModelCache.recall`): the
embeddings T5 made of the last texts, so a text seen again (the negative prompt, usually the same on every
prompt) is not encoded again and a prompt whose texts were all seen does not load T5 at all.

The cache knows nothing of the host application. A host that manages memory itself (ComfyUI) installs a
:class:`CacheHost`: it is asked to make room before a stage loads, holds each loaded model in its own
books (a handle the cache keeps while the model is kept), and readies the model on its device for each
run — which may mean moving it back after the host offloaded it to make room for its own models. With a
host, a model that is not kept is offloaded by the host itself (ComfyUI unloads it as one of its own) and
its handle waits in the same pool, under the same budget."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from .measure import NO_CUDA, format_bytes, free_memory, model_let_go
from .streaming import HostCopy, model_bytes

logger = logging.getLogger(__name__)

HOST_BUDGET_ENV = "PIXART_LOWVRAM_HOST_POOL_GIB"
MAX_RESULTS = 16  # results remembered (a text's embeddings: 2.4 MB at 300 tokens of T5-XXL in bf16)
DEFAULT_HOST_BUDGET_GIB = 4.0
CPU = torch.device("cpu")


def default_host_budget() -> int:
    """Bytes the pool may hold: ``$PIXART_LOWVRAM_HOST_POOL_GIB`` (GiB, 0 turns it off), else 4 GiB."""
    text = os.environ.get(HOST_BUDGET_ENV, "").strip()
    if not text:
        return int(DEFAULT_HOST_BUDGET_GIB * 2**30)
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if not gib >= 0:  # also NaN
        raise ValueError(
            f"{HOST_BUDGET_ENV}={text!r} is not a size: give GiB of host memory for models between runs, "
            f"e.g. {DEFAULT_HOST_BUDGET_GIB:g}, or 0 to free every model after its stage."
        )
    return int(gib * 2**30)


class CacheHost(Protocol):
    def make_room(self, needs: int, device: torch.device) -> None:
        """Free what the host holds on ``device`` until about ``needs`` bytes are free."""

    def hold(self, key: Hashable, model: torch.nn.Module, device: torch.device) -> object:
        """``model`` was just loaded on ``device``: enter it in the host's books and return the handle the
        cache keeps (the host holds it weakly: the model is dropped when the cache lets go)."""

    def ready(self, handle: object, work: int) -> torch.nn.Module:
        """The model of ``handle`` on its device with room for ``work`` more bytes, for a run (moved back
        when it was offloaded)."""

    def offload(self, handle: object) -> None:
        """Take the model of ``handle`` off its device into host memory, where it waits for a later
        :meth:`ready` (the pool holds the handle)."""


class ModelCache:
    def __init__(self, host_budget: int | None = None) -> None:
        # key -> kept model (or its HostCopy, when it came from the pool), or the host's handle of it
        self._models: dict[Hashable, object] = {}
        # key -> (the model in host memory: its HostCopy, or the host's handle; its bytes), least recently
        # used first
        self._pool: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        # (the model's key, what it was given) -> what it made, least recently used first
        self._results: OrderedDict[Hashable, object] = OrderedDict()
        self.host: CacheHost | None = None
        self.host_budget = default_host_budget() if host_budget is None else host_budget

    @contextmanager
    def use(
        self,
        key: Hashable,
        load: Callable[[], torch.nn.Module],
        keep: bool,
        device: torch.device | None = None,
        weights: int = 0,
        work: int = 0,
    ) -> Iterator[torch.nn.Module]:
        """Yield the model for ``key`` on ``device`` — kept, from the pool, or freshly loaded — and keep it
        afterwards if asked, else (without a host) put it in the pool; only if the run succeeded, so a
        failed stage never leaves its model behind.

        ``weights`` and ``work`` estimate the bytes the stage's model and its run take on ``device``: with a
        host, room for both is made before a load, and the host readies the model with room for ``work``."""
        host = self.host if device is not None else None
        entry = self._models.pop(key, None)
        if entry is not None:
            logger.info("reusing kept model %s", key)
        elif key in self._pool:
            entry, size = self._pool.pop(key)
            logger.info("reusing model %s from host memory (%s)", key, format_bytes(size))
        else:
            if host is not None:
                host.make_room(weights + work, device)
            model = load()
            entry = host.hold(key, model, device) if host is not None else model
            del model
            model_let_go()  # what loading left behind (seconds of work: the collection costs nothing here)
        if host is not None:
            model = host.ready(entry, work)
        elif isinstance(entry, HostCopy):
            entry.to(device)
            model = entry.model
        else:
            model = entry
        yield model
        if keep:
            self._models[key] = entry
        elif device is None or not self._park(key, model, entry, host):
            model_let_go()

    def _park(self, key: Hashable, model: torch.nn.Module, entry: object, host: CacheHost | None) -> bool:
        """Take ``model`` off its device into host memory — the host offloads it (its handle ``entry``), or
        without one its :class:`HostCopy` (made the first time) puts its host copies back — and into the
        pool, within the budget (least recently used out); False when it does not go there."""
        if self.host_budget <= 0:
            return False
        size = model_bytes(model)
        if size > self.host_budget:
            logger.info(
                "model %s (%s) is larger than the host memory budget (%s): not kept",
                key,
                format_bytes(size),
                format_bytes(self.host_budget),
            )
            return False
        if host is not None:
            host.offload(entry)
        elif isinstance(entry, HostCopy):
            entry.back()
        else:
            entry = HostCopy(model)
        self._pool[key] = (entry, size)
        while self.pool_bytes() > self.host_budget:
            evicted, (_entry, evicted_size) = self._pool.popitem(last=False)
            model_let_go()
            logger.info("host memory budget: dropped model %s (%s)", evicted, format_bytes(evicted_size))
        return True

    def recall(self, key: Hashable) -> object | None:
        """The result remembered under ``key`` (a model's cache key and what it was given), or None."""
        if key not in self._results:
            return None
        self._results.move_to_end(key)
        return self._results[key]

    def remember(self, key: Hashable, value: object) -> object:
        """Remember ``value`` (small, on the CPU, what the model computes the same way every time) under
        ``key`` for :meth:`recall`, the :data:`MAX_RESULTS` most recently used kept; return it."""
        self._results[key] = value
        self._results.move_to_end(key)
        while len(self._results) > MAX_RESULTS:
            self._results.popitem(last=False)
        return value

    def forget_results(self) -> None:
        """Forget every remembered result (the models stay)."""
        self._results.clear()

    def pool_bytes(self) -> int:
        """Bytes of CPU memory the models waiting in the pool hold."""
        return sum(size for _copy, size in self._pool.values())

    def pool_summary(self) -> str:
        """One line on what waits in host memory, against the budget and the setting that changes it (a front
        end adds how its users empty it)."""
        if self.host_budget <= 0:
            return f"host memory: no models kept between runs ({HOST_BUDGET_ENV}=0)"
        return (
            f"host memory: {len(self._pool)} model(s) waiting for the next run, {format_bytes(self.pool_bytes())} "
            f"of {format_bytes(self.host_budget)} ({HOST_BUDGET_ENV} sets the budget)"
        )

    def pooled(self) -> list[Hashable]:
        """The keys of the models waiting in host memory, least recently used first."""
        return list(self._pool)

    def clear(self, collect: bool = True) -> int:
        """Drop every kept model, every model waiting in host memory and the remembered results; return how
        many models were kept. ``collect=False`` leaves garbage collection to the caller (a weakref finalizer
        must not run one)."""
        count = len(self._models)
        self._models.clear()
        self._pool.clear()
        self.forget_results()
        free_memory(collect=collect)
        return count

    def __len__(self) -> int:
        """How many models are kept (not counting those waiting in host memory)."""
        return len(self._models)

    def __contains__(self, key: Hashable) -> bool:
        """Whether the model of ``key`` is kept (not counting those waiting in host memory)."""
        return key in self._models

    def keys(self) -> list[Hashable]:
        return list(self._models)


cache = ModelCache()


@dataclass
class FreeResult:
    models_dropped: int
    allocated_before: int | None
    allocated_after: int | None
    pooled_dropped: int = 0
    pooled_bytes: int = 0

    def summary(self) -> str:
        dropped = f"dropped {self.models_dropped} kept model(s)"
        if self.pooled_dropped:
            dropped += f" and {self.pooled_dropped} from host memory ({format_bytes(self.pooled_bytes)})"
        if self.allocated_before is None:
            return f"{dropped}; {NO_CUDA}"
        freed = self.allocated_before - self.allocated_after
        return (
            f"{dropped}; freed {format_bytes(max(freed, 0))} "
            f"(allocated {format_bytes(self.allocated_before)} -> {format_bytes(self.allocated_after)})"
        )


def free_all(release_others: Callable[[], object] | None = None) -> FreeResult:
    """Drop the pack's kept and pooled models and, through ``release_others``, anything the host
    application holds."""
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    pooled, pooled_bytes = len(cache.pooled()), cache.pool_bytes()
    dropped = cache.clear()
    if release_others is not None:
        release_others()
    free_memory()
    after = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    return FreeResult(dropped, before, after, pooled, pooled_bytes)
