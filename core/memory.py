"""Stage accounting: each stage is one context that times it, records its GPU peaks and frees.

A stage's figures go into a :class:`MemoryReport` (one per prompt or command-line run). The
allocator history (for PyTorch's memory viewer) is process-wide; it is started before the first
stage and dumped by whoever asked for the snapshot.
"""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import outputs

logger = logging.getLogger(__name__)

NO_CUDA = "no CUDA"
HISTORY_MAX_ENTRIES = 200_000


def cuda_in_use(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def free_memory() -> None:
    """Collect garbage and hand cached CUDA blocks back to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        # cuBLAS keeps a 32 MiB workspace from the caching allocator for the life of the process; left
        # alone it pins the segment it sits in (transformers' loading warm-up makes that a 4 GB one).
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


@dataclass
class StageRecord:
    stage: str
    device: str
    seconds: float
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    # What other code held when the stage began: the stage's own share is peak - start.
    start_allocated: int | None = None
    start_reserved: int | None = None
    error: str | None = None

    def cells(self) -> list[str]:
        if self.peak_allocated is None:
            alloc = reserved = NO_CUDA
        else:
            alloc, reserved = format_bytes(self.peak_allocated), format_bytes(self.peak_reserved)
        status = f" (failed: {self.error})" if self.error else ""
        return [self.stage + status, self.device, alloc, reserved, f"{self.seconds:.2f}"]


@dataclass
class MemoryReport:
    """Per-stage figures of one prompt (or one command-line run)."""

    stages: list[StageRecord] = field(default_factory=list)

    HEADER = ("stage", "device", "peak allocated", "peak reserved", "seconds")

    def add(self, record: StageRecord) -> None:
        self.stages.append(record)

    @property
    def peak_allocated(self) -> int | None:
        peaks = [s.peak_allocated for s in self.stages if s.peak_allocated is not None]
        return max(peaks) if peaks else None

    def markdown(self) -> str:
        rows = [list(self.HEADER), ["---"] * len(self.HEADER)]
        rows += [s.cells() for s in self.stages]
        return "\n".join("| " + " | ".join(r) + " |" for r in rows)

    def to_dict(self) -> dict:
        return {"stages": [asdict(s) for s in self.stages], "peak_allocated": self.peak_allocated}

    def write(self, stem: Path) -> list[Path]:
        """Write ``stem.json`` and ``stem.md``; return the paths."""
        json_path, md_path = (stem.with_name(stem.name + ext) for ext in (".json", ".md"))
        json_path.write_text(json.dumps(self.to_dict(), indent=2))
        md_path.write_text(self.markdown() + "\n")
        return [json_path, md_path]


class ReportBook:
    """Reports by run id (ComfyUI's prompt id), the oldest dropped past ``max_runs``."""

    def __init__(self, max_runs: int = 16):
        self.max_runs = max_runs
        self._reports: OrderedDict[str, MemoryReport] = OrderedDict()

    def get(self, run_id: str) -> MemoryReport:
        report = self._reports.pop(run_id, None) or MemoryReport()
        self._reports[run_id] = report
        while len(self._reports) > self.max_runs:
            self._reports.popitem(last=False)
        return report


reports = ReportBook()


def format_bytes(n: int | None) -> str:
    if n is None:
        return NO_CUDA
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@contextmanager
def stage(name: str, device: torch.device | str, report: MemoryReport | None = None) -> Iterator[None]:
    """Run one stage under ``inference_mode``, record its peaks and time, and free afterwards.

    On an exception the frames of the traceback are cleared before freeing, so a model loaded
    inside the stage is not kept alive by the exception that is propagating.
    """
    device = torch.device(device)
    on_cuda = cuda_in_use(device)
    record = StageRecord(stage=name, device=str(device), seconds=0.0)
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        record.start_allocated = torch.cuda.memory_allocated(device)
        record.start_reserved = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            yield
        if on_cuda:
            torch.cuda.synchronize(device)
    except BaseException as exc:
        record.error = type(exc).__name__
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        record.seconds = time.perf_counter() - start
        if on_cuda:
            record.peak_allocated = torch.cuda.max_memory_allocated(device)
            record.peak_reserved = torch.cuda.max_memory_reserved(device)
        if report is not None:
            report.add(record)
        free_memory()
        logger.info("stage %s", " | ".join(record.cells()))


class History:
    """The process-wide CUDA allocator history (for PyTorch's memory viewer), recorded for one run."""

    def __init__(self) -> None:
        self.run_id: str | None = None

    def ensure(self, run_id: str) -> bool:
        """Record from now on for ``run_id``; False when there is no CUDA."""
        if not torch.cuda.is_available():
            return False
        if self.run_id is None:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_MAX_ENTRIES)
        self.run_id = run_id
        return True

    def dump(self, path: Path) -> Path | None:
        """Write the snapshot pickle and stop recording; None without CUDA."""
        if not torch.cuda.is_available():
            return None
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.run_id = None
        return path


history = History()


def write_record(report: MemoryReport, folder: Path, prefix: str) -> str:
    """Write the stage table (.md, .json) and, with CUDA, the allocator snapshot (.pickle) under
    ``folder``; return a summary for the user."""
    stem = outputs.next_stem(folder, prefix)
    written = report.write(stem)
    snapshot = history.dump(stem.with_name(stem.name + ".pickle"))
    if snapshot is not None:
        written.append(snapshot)
    lines = [
        report.markdown() if report.stages else "no stage of the pack ran in this prompt (cached outputs?)"
    ]
    peak = report.peak_allocated
    lines.append(f"peak allocated over the prompt: {format_bytes(peak)}")
    if snapshot is None:
        lines.append(f"{NO_CUDA}: no allocator snapshot")
    lines.append("files: " + ", ".join(p.name for p in written))
    return "\n".join(lines)
