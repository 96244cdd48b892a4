"""Run ComfyUI's main.py as on a card of ``$PIXART_LOWVRAM_CARD_GIB`` GiB: ``python card_limit.py main.py
ARGS`` from the ComfyUI folder.

When ComfyUI's memory manager (comfy.model_management) is imported, before it reads the card's size, torch's
allocator is capped at that size less this process's CUDA context (``torch.cuda.set_per_process_memory_fraction``;
the context as NVML reports it) and ``torch.cuda.mem_get_info`` answers for that card: its size as the
total, and as free what the context and this process's allocator leave of it (never more than the real
card's free memory). ComfyUI and the pack plan with those
figures, and an allocation past the cap raises torch's out-of-memory error as on the small card. Dynamic
VRAM (comfy-aimdo) reads the card itself: the benchmark gives it ``--vram-headroom``. Torch is not imported
before ComfyUI imports it (main.py sets its allocator first). Without CUDA nothing is changed.
"""

import importlib.abc
import importlib.machinery
import os
import runpy
import sys

MANAGER = "comfy.model_management"


def own_usage() -> int:
    """This process's memory on the card (its CUDA context, before any allocation), 0 where NVML cannot
    tell."""
    import harness  # beside this file, on the path as the script's folder

    return harness.GpuWatch([os.getpid()]).own_now() or 0


def limit(card: int) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    context = own_usage()
    torch.cuda.set_per_process_memory_fraction(min((card - context) / total, 1.0))
    real = torch.cuda.mem_get_info

    def mem_get_info(device=None):
        free, _ = real(device)
        return min(free, max(card - context - torch.cuda.memory_reserved(device), 0)), card

    torch.cuda.mem_get_info = mem_get_info


class LimitFirst(importlib.abc.MetaPathFinder):
    """Finds the memory manager as Python would, and runs :func:`limit` just before its code."""

    def __init__(self, card: int):
        self.card = card

    def find_spec(self, name, path, target=None):
        if name != MANAGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module

        def exec_module(module):
            limit(self.card)
            run_module(module)

        spec.loader.exec_module = exec_module
        return spec


if __name__ == "__main__":
    sys.meta_path.insert(0, LimitFirst(int(float(os.environ["PIXART_LOWVRAM_CARD_GIB"]) * 2**30)))
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.getcwd())
    runpy.run_path(sys.argv[0], run_name="__main__")
