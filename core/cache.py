"""Models kept loaded between runs when a node asks for it (the default is to unload)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .memory import NO_CUDA, format_bytes, free_memory

logger = logging.getLogger(__name__)


class ModelCache:
    def __init__(self) -> None:
        self._models: dict[Hashable, torch.nn.Module] = {}

    @contextmanager
    def use(
        self, key: Hashable, load: Callable[[], torch.nn.Module], keep: bool
    ) -> Iterator[torch.nn.Module]:
        """Yield the model for ``key`` (cached or freshly loaded); keep it afterwards only if asked and
        the run succeeded, so a failed stage never leaves its model behind."""
        model = self._models.pop(key, None)
        if model is None:
            model = load()
        else:
            logger.info("reusing kept model %s", key)
        yield model
        if keep:
            self._models[key] = model

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
