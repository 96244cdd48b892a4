"""Models kept loaded between runs when a node asks for it (the default is to unload)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch

from .memory import free_memory

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
