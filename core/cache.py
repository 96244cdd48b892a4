"""Models kept loaded between runs when a node asks for it (the default is to unload).

The cache knows nothing of the host application. A host that manages memory itself (ComfyUI) installs a
:class:`CacheHost`: it is told what is kept and what leaves, is asked to make room before a stage loads,
and may take a kept model back (``evict``) when it needs the memory."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from .memory import NO_CUDA, format_bytes, free_memory

logger = logging.getLogger(__name__)


class CacheHost(Protocol):
    def make_room(self, needs: int, device: torch.device) -> None:
        """Free what the host holds on ``device`` until about ``needs`` bytes are free."""

    def kept(self, key: Hashable, model: torch.nn.Module, device: torch.device) -> None:
        """``model`` is kept on ``device``: account for it (and call ``cache.evict(key)`` to take it back)."""

    def released(self, key: Hashable) -> None:
        """The model for ``key`` left the cache (in use, dropped or evicted): forget it."""


class ModelCache:
    def __init__(self) -> None:
        self._models: dict[Hashable, torch.nn.Module] = {}
        self.host: CacheHost | None = None

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
        """Yield the model for ``key`` (cached or freshly loaded); keep it afterwards only if asked and
        the run succeeded, so a failed stage never leaves its model behind.

        ``weights`` and ``work`` estimate the bytes the stage's model and its run take on ``device``: the
        host is asked for room for both before a load, for ``work`` before a kept model runs again. A kept
        model leaves the host's books while it runs, so making room cannot evict it."""
        model = self._models.pop(key, None)
        if model is not None:
            self._released(key)
        if self.host is not None and device is not None:
            needs = work if model is not None else weights + work
            if needs > 0:
                self.host.make_room(needs, device)
        if model is None:
            model = load()
        else:
            logger.info("reusing kept model %s", key)
        yield model
        if keep:
            self._models[key] = model
            if self.host is not None and device is not None:
                self.host.kept(key, model, device)

    def evict(self, key: Hashable) -> bool:
        """Drop one kept model now (the host needs its memory); False if it is not kept."""
        model = self._models.pop(key, None)
        if model is None:
            return False
        self._released(key)
        del model
        free_memory()
        logger.info("unloaded kept model %s", key)
        return True

    def clear(self) -> int:
        """Drop every kept model; return how many there were."""
        keys = list(self._models)
        self._models.clear()
        for key in keys:
            self._released(key)
        free_memory()
        return len(keys)

    def _released(self, key: Hashable) -> None:
        if self.host is not None:
            self.host.released(key)

    def __len__(self) -> int:
        return len(self._models)

    def keys(self) -> list[Hashable]:
        return list(self._models)


cache = ModelCache()


@dataclass
class FreeResult:
    models_dropped: int
    allocated_before: int | None
    allocated_after: int | None

    def summary(self) -> str:
        dropped = f"dropped {self.models_dropped} kept model(s)"
        if self.allocated_before is None:
            return f"{dropped}; {NO_CUDA}"
        freed = self.allocated_before - self.allocated_after
        return (
            f"{dropped}; freed {format_bytes(max(freed, 0))} "
            f"(allocated {format_bytes(self.allocated_before)} -> {format_bytes(self.allocated_after)})"
        )


def free_all(release_others: Callable[[], object] | None = None) -> FreeResult:
    """Drop the pack's kept models and, through ``release_others``, anything the host application holds."""
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    dropped = cache.clear()
    if release_others is not None:
        release_others()
    free_memory()
    after = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    return FreeResult(dropped, before, after)
