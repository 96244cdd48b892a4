"""Models kept loaded between runs when a node asks for it (the default is to unload).

The cache knows nothing of the host application. A host that manages memory itself (ComfyUI) installs a
:class:`CacheHost`: it is asked to make room before a stage loads, holds each loaded model in its own
books (a handle the cache keeps while the model is kept), and readies the model on its device for each
run — which may mean moving it back after the host offloaded it to make room for its own models."""

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

    def hold(self, key: Hashable, model: torch.nn.Module, device: torch.device) -> object:
        """``model`` was just loaded on ``device``: enter it in the host's books and return the handle the
        cache keeps (the host holds it weakly: the model is dropped when the cache lets go)."""

    def ready(self, handle: object, work: int) -> torch.nn.Module:
        """The model of ``handle`` on its device with room for ``work`` more bytes, for a run."""


class ModelCache:
    def __init__(self) -> None:
        self._models: dict[Hashable, object] = {}  # key -> model, or the host's handle of it
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
        """Yield the model for ``key`` (kept or freshly loaded); keep it afterwards only if asked and the
        run succeeded, so a failed stage never leaves its model behind.

        ``weights`` and ``work`` estimate the bytes the stage's model and its run take on ``device``: with a
        host, room for both is made before a load, and the host readies the model with room for ``work``."""
        host = self.host if device is not None else None
        entry = self._models.pop(key, None)
        if entry is None:
            if host is not None:
                host.make_room(weights + work, device)
            model = load()
            entry = host.hold(key, model, device) if host is not None else model
            del model
        else:
            logger.info("reusing kept model %s", key)
        yield host.ready(entry, work) if host is not None else entry
        if keep:
            self._models[key] = entry

    def clear(self) -> int:
        """Drop every kept model; return how many there were."""
        count = len(self._models)
        self._models.clear()
        free_memory()
        return count

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
