"""Stage accounting: each stage is one context that times it, records its GPU peaks and frees.

A stage's figures go into a :class:`MemoryReport` (one per prompt or command-line run). The
allocator history (for PyTorch's memory viewer) is process-wide; it is started before the first
stage and dumped by whoever asked for the snapshot.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NO_CUDA = "no CUDA"
HISTORY_MAX_ENTRIES = 200_000


def trace_clock_us() -> int:
    """Now, in microseconds on the clock of the allocator trace's ``time_us``.

    c10 stamps trace entries with ``c10::getTime()`` (converted from the TSC where it uses one,
    c10/util/ApproximateClock.h): ``CLOCK_REALTIME`` on Linux, the time since the epoch that
    ``time.time_ns()`` reads; ``steady_clock`` on Windows, QueryPerformanceCounter, which
    ``time.perf_counter_ns()`` reads there."""
    return (time.perf_counter_ns() if sys.platform == "win32" else time.time_ns()) // 1000


def cuda_in_use(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


# Set when a model was let go (:func:`model_let_go`): the end of the stage collects garbage then.
_model_let_go = False


def model_let_go() -> None:
    """A model was let go: the stage's end collects garbage, since models hold reference cycles (hooks,
    back-references) that only the collector frees. A stage whose model was kept or put in the host-memory
    pool skips the collection, which takes a tenth of a second or more in a process of this size."""
    global _model_let_go
    _model_let_go = True


def free_memory(collect: bool = True) -> None:
    """Collect garbage (``collect``) and hand cached CUDA blocks back to the driver."""
    global _model_let_go
    if collect:
        _model_let_go = False
        gc.collect()
    if torch.cuda.is_available():
        # cuBLAS keeps a 32 MiB workspace from the caching allocator for the life of the process; left
        # alone it pins the segment it sits in (transformers' loading warm-up makes that a 4 GB one).
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


ALLOCATOR_SETTINGS = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def prefer_expandable_segments() -> bool:
    """Ask PyTorch's CUDA allocator for expandable segments unless its settings were chosen already (Linux
    only: elsewhere PyTorch does not offer them). Call before CUDA's first allocation (the command line
    does, at its start). With them the stages' memory goes back to the driver and comes back without the
    allocator's fragmentation: measured on an H200 at 1024², GPU peak reserved 2.65 GiB instead of 2.92 for
    2.62 allocated, at the same speed within the run's spread (git log -p -- benchmarks/results/warm.json).
    Returns whether it set
    them."""
    if not sys.platform.startswith("linux") or os.environ.get(ALLOCATOR_SETTINGS):
        return False
    os.environ[ALLOCATOR_SETTINGS] = EXPANDABLE_SEGMENTS
    return True


def device_room(device: torch.device | str) -> int:
    """Bytes a new allocation on ``device`` can take: the driver's free memory plus what the allocator
    holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


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
    # When the stage began and ended, on the allocator trace's clock (trace_clock_us), to place it on the
    # memory timeline.
    started_us: int | None = None
    ended_us: int | None = None

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


def _clear_frames(exc: BaseException, drop: bool = False) -> None:
    """Clear the frames of ``exc``'s traceback and of the exceptions it was raised from or during (a library
    that catches an error and raises another keeps the first one, and its frames, in the chain). With
    ``drop`` the tracebacks are also cut apart and let go: a cleared frame still holds its function, a closure
    such as torch's wrapper of a module with hooks holds the module, and the with-statement's ``__exit__``
    holds the traceback as an argument."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        if drop:
            link, current.__traceback__ = current.__traceback__, None
            while link is not None:
                following = link.tb_next
                link.tb_next = None
                link = following
        pending += [current.__cause__, current.__context__]


# The last advice of every stage; a front end may add how its users do that (the nodes add their own words).
FREE_OTHERS = "and free the GPU memory other models hold first"
# When a stage does not say what lowers its peak (its settings' ``out_of_memory_advice``).
GENERIC_ADVICE = f"lower width, height or batch_size, turn on low_vram, {FREE_OTHERS}"


def out_of_memory_message(name: str, device: torch.device, exc: BaseException, advice: str | None) -> str:
    """Which stage ran out of GPU memory, what it had to work with, and what to change."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"stage {name} ran out of GPU memory on {device} ({first_line}). Its model was unloaded. To fit: "
        f"{advice or GENERIC_ADVICE}; then run it again."
    )


@contextmanager
def stage(
    name: str, device: torch.device | str, report: MemoryReport | None = None, advice: str | None = None
) -> Iterator[None]:
    """Run one stage under ``inference_mode``, record its peaks and time, and free afterwards.

    On an exception the frames of the traceback are cleared before freeing, so a model loaded
    inside the stage is not kept alive by the exception that is propagating. An out-of-memory error is
    raised again as one that names the stage and what to change: ``advice``, from the stage's settings
    (:func:`out_of_memory_message`).
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
    record.started_us = trace_clock_us()
    try:
        with torch.inference_mode():
            yield
        if on_cuda:
            torch.cuda.synchronize(device)
    except BaseException as exc:
        record.error = type(exc).__name__
        out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError)
        # Out of memory, the memory must come back now; the new message says where it ran out.
        _clear_frames(exc, drop=out_of_memory)
        if out_of_memory:
            # Still an OutOfMemoryError, so ComfyUI shows its own out-of-memory advice as well.
            raise torch.cuda.OutOfMemoryError(out_of_memory_message(name, device, exc, advice)) from exc
        raise
    finally:
        record.seconds = time.perf_counter() - start
        record.ended_us = trace_clock_us()
        if on_cuda:
            record.peak_allocated = torch.cuda.max_memory_allocated(device)
            record.peak_reserved = torch.cuda.max_memory_reserved(device)
        if report is not None:
            report.add(record)
        free_memory(collect=record.error is not None or _model_let_go)
        logger.info("stage %s", " | ".join(record.cells()))


def history_problem() -> str | None:
    """Why the CUDA allocator history cannot be recorded in this process; None when it can."""
    if not torch.cuda.is_available():
        return NO_CUDA
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        return (
            f"PyTorch's {backend} allocator keeps none (ComfyUI picks cudaMallocAsync by default); start "
            "ComfyUI with --disable-cuda-malloc to record it. The stage table and peaks do not need it"
        )
    return None


class History:
    """The process-wide CUDA allocator history (for PyTorch's memory viewer), recorded for one run."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        # When this run's recording began (trace_clock_us): the timeline starts there, and events of an
        # earlier run still in the buffer only set the level it starts from.
        self.started_us: int | None = None
        self.warned = False

    def ensure(self, run_id: str) -> bool:
        """Record from now on for ``run_id``; False when it cannot be recorded (:func:`history_problem`)."""
        problem = history_problem()
        if problem is not None:
            if problem != NO_CUDA and not self.warned:
                logger.warning("no allocator history: %s", problem)
                self.warned = True  # once a process: the Memory Snapshot node says it every prompt
            return False
        if self.run_id != run_id:
            self.started_us = trace_clock_us()
        if self.run_id is None:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_MAX_ENTRIES)
        self.run_id = run_id
        return True

    def dump(self, path: Path) -> dict | None:
        """Write the allocator snapshot to ``path`` (a pickle, as ``torch.cuda.memory._dump_snapshot``
        writes it), stop recording and return the snapshot; None when nothing was recorded."""
        if self.run_id is None or not torch.cuda.is_available():
            return None
        snapshot = torch.cuda.memory._snapshot()
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        self.stop()
        return snapshot

    def stop(self) -> None:
        """Stop recording, keeping nothing (nothing to do when not recording)."""
        if self.run_id is None:
            return
        torch.cuda.memory._record_memory_history(enabled=None)
        self.run_id = None


history = History()
