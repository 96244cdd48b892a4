"""The memory record of a run (``write_report``: the stage table, and when asked the timeline picture and the
allocator snapshot) and the timeline picture itself: CUDA memory allocated and reserved over a run, each stage
shaded and the peak labelled, rebuilt from the allocator history (the dict ``torch.cuda.memory._snapshot()``
returns).

Without allocator history (a CPU run, or recording off) the picture shows the per-stage figures instead.
matplotlib is imported only to draw, on its Agg canvas (no display, no network): a record without the picture
never imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from . import measure, outputs
from .measure import NO_CUDA, StageRecord, format_bytes

logger = logging.getLogger(__name__)

# Allocator trace actions and what they do to the bytes allocated / reserved. An allocation stops counting when
# its free is requested, as in the allocator's statistics (torch.cuda.memory_allocated), even while the block
# waits for another stream; segment_map/unmap are the expandable-segment forms of segment_alloc/free. Others
# (free_completed, oom, snapshot) change neither.
ALLOCATED_STEP = {"alloc": 1, "free_requested": -1}
RESERVED_STEP = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
MAX_PLOT_POINTS = 4000  # per line; the peak is found on every event
FIG_SIZE, DPI = (10.0, 5.0), 100  # 1000 × 500 px
NO_HISTORY = "no CUDA allocator history on this device"
# Stage times and the trace share one clock (measure.trace_clock_us); stages farther than this from every
# event are taken to be on another clock and are not placed on the timeline.
CLOCK_TOLERANCE_US = 3600 * 10**6


@dataclass
class Series:
    """Bytes allocated and reserved on one device after each event of its trace."""

    device: int
    time_us: np.ndarray
    allocated: np.ndarray
    reserved: np.ndarray


@dataclass
class Peak:
    allocated: int
    reserved: int  # reserved at the same moment
    time_us: int
    device: int
    stage: str | None  # None: between stages, or stages not on the trace's clock

    def label(self) -> str:
        where = f"in {self.stage}" if self.stage else "between stages"
        return (
            f"peak {format_bytes(self.allocated)} allocated ({format_bytes(self.reserved)} reserved) {where}"
        )


def _device_end_state(snapshot: dict) -> dict[int, tuple[int, int]]:
    """(allocated, reserved) per device when the snapshot was taken, from its segments.

    Trace events carry requested sizes, so allocated is summed the same way (a block's requested size, not
    its rounded size), over the blocks in use (not those awaiting a free, as in ALLOCATED_STEP)."""
    state: dict[int, tuple[int, int]] = {}
    for segment in snapshot.get("segments", []):
        device = segment.get("device", 0)
        blocks = segment.get("blocks")
        if blocks is None:
            allocated = segment.get("allocated_size", 0)
        else:
            allocated = sum(
                b.get("requested_size", b["size"]) for b in blocks if b["state"] == "active_allocated"
            )
        old_allocated, old_reserved = state.get(device, (0, 0))
        state[device] = (old_allocated + allocated, old_reserved + segment["total_size"])
    return state


def device_series(snapshot: dict, since_us: int | None = None) -> list[Series]:
    """One :class:`Series` per device whose trace has events at or after ``since_us``; its first point is the
    level before them (at ``since_us`` when given).

    The trace holds changes only, and it starts when recording started (or later: it is a ring buffer), when
    memory may already be in use. So the level before the first event is the state at dump time (the
    snapshot's segments) minus the trace's net change; events before ``since_us`` (an earlier run's) are
    folded into the starting level."""
    end_state = _device_end_state(snapshot)
    result = []
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        events = [e for e in trace if e["action"] in ALLOCATED_STEP or e["action"] in RESERVED_STEP]
        if not events:
            continue
        time_us = np.array([e["time_us"] for e in events], dtype=np.int64)
        sizes = np.array([e["size"] for e in events], dtype=np.int64)
        alloc_steps = np.array([ALLOCATED_STEP.get(e["action"], 0) for e in events], dtype=np.int64) * sizes
        reserve_steps = np.array([RESERVED_STEP.get(e["action"], 0) for e in events], dtype=np.int64) * sizes
        order = np.argsort(time_us, kind="stable")  # recorded in order; a stable sort only guards that
        time_us, alloc_steps, reserve_steps = time_us[order], alloc_steps[order], reserve_steps[order]
        end_allocated, end_reserved = end_state.get(device, (0, 0))
        # Levels before each event and after the last: [start, after event 0, …].
        allocated = end_allocated - alloc_steps.sum() + np.concatenate([[0], np.cumsum(alloc_steps)])
        reserved = end_reserved - reserve_steps.sum() + np.concatenate([[0], np.cumsum(reserve_steps)])
        first = 0 if since_us is None else int(np.searchsorted(time_us, since_us, side="left"))
        if first == len(time_us):
            continue
        start = time_us[first] if since_us is None else min(since_us, time_us[first])
        result.append(
            Series(
                device,
                np.concatenate([[start], time_us[first:]]),
                allocated[first:],
                reserved[first:],
            )
        )
    return result


def stage_at(stages: Sequence[StageRecord], time_us: int) -> str | None:
    for record in stages:
        if record.started_us is not None and record.started_us <= time_us <= record.ended_us:
            return record.stage
    return None


def find_peak(series: Sequence[Series], stages: Sequence[StageRecord]) -> Peak | None:
    """The highest allocated level over every event of every device (exact: not the plotted points)."""
    best = None
    for s in series:
        i = int(np.argmax(s.allocated))
        if best is None or s.allocated[i] > best.allocated:
            best = Peak(int(s.allocated[i]), int(s.reserved[i]), int(s.time_us[i]), s.device, None)
    if best is not None:
        best.stage = stage_at(stages, best.time_us)
    return best


def envelope(n: int, values: Sequence[np.ndarray], max_points: int = MAX_PLOT_POINTS) -> np.ndarray:
    """Indices of at most about ``max_points`` events that keep each bucket's first, lowest and highest
    value of every array, so a long trace plots fast and no spike disappears."""
    if n <= max_points:
        return np.arange(n)
    edges = np.linspace(0, n, max(max_points // (1 + 2 * len(values)), 1) + 1).astype(np.int64)
    keep = [edges[:-1], [n - 1]]
    for v in values:
        for start, stop in pairwise(edges):
            chunk = v[start:stop]
            keep.append([start + int(np.argmin(chunk)), start + int(np.argmax(chunk))])
    return np.unique(np.concatenate([np.asarray(k, dtype=np.int64) for k in keep]))


def _on_trace_clock(stages: Sequence[StageRecord], series: Sequence[Series]) -> list[StageRecord]:
    timed = [r for r in stages if r.started_us is not None and r.ended_us is not None]
    if not timed or not series:
        return []
    first = min(int(s.time_us[0]) for s in series)
    last = max(int(s.time_us[-1]) for s in series)
    if any(
        r.ended_us < first - CLOCK_TOLERANCE_US or r.started_us > last + CLOCK_TOLERANCE_US for r in timed
    ):
        logger.warning("stage times are not on the allocator trace's clock; the timeline shows no stages")
        return []
    return timed


def _unit(max_bytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if max_bytes >= 2**30 else (2**20, "MiB")


def _figure():
    from matplotlib.figure import Figure

    # A bare Figure drawn on an Agg canvas, not pyplot: no backend to choose (the process's stays as it is),
    # no global figure registry, nothing left open between runs.
    fig = Figure(figsize=FIG_SIZE, dpi=DPI)
    return fig, fig.add_subplot()


def _to_rgb(fig) -> np.ndarray:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _draw_timeline(ax, series: Sequence[Series], stages: Sequence[StageRecord], peak: Peak) -> None:
    import matplotlib.transforms as mtransforms

    timed = _on_trace_clock(stages, series)
    origin = min([int(s.time_us[0]) for s in series] + [r.started_us for r in timed])
    end = max([int(s.time_us[-1]) for s in series] + [r.ended_us for r in timed])
    scale, unit = _unit(max(float(s.reserved.max()) for s in series))
    several = len(series) > 1
    for s in series:
        keep = envelope(len(s.time_us), [s.allocated, s.reserved])
        peak_i = int(np.argmax(s.allocated))
        keep = np.union1d(keep, [peak_i])
        # Hold the last level to the end of the run.
        t = np.append((s.time_us[keep] - origin) / 1e6, (end - origin) / 1e6)
        allocated = np.append(s.allocated[keep], s.allocated[-1]) / scale
        reserved = np.append(s.reserved[keep], s.reserved[-1]) / scale
        suffix = f" (cuda:{s.device})" if several else ""
        ax.fill_between(t, allocated, step="post", alpha=0.35, color="tab:blue", linewidth=0)
        ax.step(t, allocated, where="post", color="tab:blue", linewidth=1.2, label="allocated" + suffix)
        ax.step(t, reserved, where="post", color="tab:orange", linewidth=1.2, label="reserved" + suffix)
    span = max((end - origin) / 1e6, 1e-6)
    label_at = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    for i, record in enumerate(timed):
        start, stop = (record.started_us - origin) / 1e6, (record.ended_us - origin) / 1e6
        ax.axvspan(start, stop, color="0.5" if i % 2 else "tab:green", alpha=0.12, linewidth=0)
        narrow = (stop - start) < 0.08 * span
        name = record.stage + (" (failed)" if record.error else "")
        ax.text(
            (start + stop) / 2,
            0.98,
            name,
            transform=label_at,
            ha="center",
            va="top",
            rotation=90 if narrow else 0,
            fontsize=8,
            clip_on=True,
        )
    x, y = (peak.time_us - origin) / 1e6, peak.allocated / scale
    ax.plot([x], [y], "o", color="tab:red")
    ax.annotate(
        peak.label() + (f" on cuda:{peak.device}" if several else ""),
        (x, y),
        xytext=(0.5, 0.90),
        textcoords="axes fraction",
        ha="center",
        fontsize=9,
        color="tab:red",
        arrowprops={"arrowstyle": "->", "color": "tab:red"},
    )
    ax.set_xlim(0, span)
    ax.set_ylim(0, max(float(s.reserved.max()) for s in series) / scale * 1.25 or 1)
    ax.set_xlabel("seconds since recording started")
    ax.set_ylabel(unit)
    ax.set_title("CUDA memory over the run", loc="left")
    # Above the plot, right of the title: inside it would cover the first stage's name.
    ax.legend(loc="lower right", bbox_to_anchor=(1, 1), ncol=2 * len(series), frameon=False, fontsize=8)


def _draw_stages(ax, stages: Sequence[StageRecord]) -> None:
    """Per-stage bars: the peaks where they were measured (CUDA without history), else the stage times."""
    if not stages:
        ax.text(0.5, 0.5, "no stage of the pack ran in this run", ha="center", va="center", fontsize=12)
        ax.set_axis_off()
        ax.set_title(NO_HISTORY)
        return
    names = [r.stage + (" (failed)" if r.error else "") for r in stages]
    y = np.arange(len(stages))[::-1]
    if any(r.peak_allocated is not None for r in stages):
        scale, unit = _unit(max(r.peak_reserved or 0 for r in stages))
        allocated = [(r.peak_allocated or 0) / scale for r in stages]
        reserved = [(r.peak_reserved or 0) / scale for r in stages]
        ax.barh(y + 0.2, reserved, height=0.4, color="tab:orange", label="peak reserved")
        ax.barh(y - 0.2, allocated, height=0.4, color="tab:blue", label="peak allocated")
        for yi, r, a in zip(y, stages, allocated, strict=True):
            ax.text(
                a, yi - 0.2, f" {format_bytes(r.peak_allocated)}, {r.seconds:.2f} s", va="center", fontsize=8
            )
        ax.set_xlabel(unit)
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title("no allocator history recorded: peak memory per stage")
    else:
        # Stage spans on the wall clock when recorded, else one after another.
        starts = np.cumsum([0.0] + [r.seconds for r in stages[:-1]])
        if all(r.started_us is not None for r in stages):
            origin = min(r.started_us for r in stages)
            starts = np.array([(r.started_us - origin) / 1e6 for r in stages])
        seconds = [r.seconds for r in stages]
        ax.barh(y, seconds, left=starts, height=0.6, color="tab:green")
        for yi, start, r in zip(y, starts, stages, strict=True):
            ax.text(
                start + r.seconds, yi, f" {r.seconds:.2f} s, {r.device}: {NO_CUDA}", va="center", fontsize=8
            )
        ax.set_xlabel("seconds")
        ax.set_xlim(0, max(starts[i] + seconds[i] for i in range(len(stages))) * 1.35 or 1)
        ax.set_title(f"{NO_HISTORY}: stage times")
    ax.set_yticks(y, names)


@dataclass
class Timeline:
    """What the picture shows: the per-device series (empty without history), the stages and the peak."""

    series: list[Series]
    stages: list[StageRecord]
    peak: Peak | None

    def picture(self) -> np.ndarray:
        """The picture as ``[H, W, 3]`` uint8 RGB."""
        fig, ax = _figure()
        if self.peak is not None:
            _draw_timeline(ax, self.series, self.stages, self.peak)
        else:
            _draw_stages(ax, self.stages)
        fig.tight_layout()
        return _to_rgb(fig)

    def save(self, path: Path) -> np.ndarray:
        """Write the picture as a PNG at ``path`` and return it."""
        from PIL import Image

        rgb = self.picture()
        Image.fromarray(rgb).save(path)
        return rgb


def build(stages: Sequence[StageRecord], snapshot: dict | None, since_us: int | None = None) -> Timeline:
    """The timeline of ``stages`` from an allocator snapshot (None: no history), counting from ``since_us``
    (when recording started, on the trace's clock)."""
    series = device_series(snapshot, since_us) if snapshot is not None else []
    return Timeline(series, list(stages), find_peak(series, stages))


@dataclass
class Record:
    """What :func:`write_report` wrote, the timeline picture (None when none was drawn) and a summary for the
    user."""

    files: list[Path]
    picture: np.ndarray | None  # [H, W, 3] uint8 RGB
    summary: str


def write_report(
    report: measure.MemoryReport, stem: Path, picture: bool = True, history: bool = True
) -> Record:
    """Write ``stem.md`` and ``stem.json`` (the stage table) and, with ``picture``, ``stem.png`` (the memory
    timeline). With ``history``, when the allocator history was recorded, also ``stem.pickle`` (the
    snapshot, which also stops the recording); without it the recording is left as it is.

    Without ``picture`` nothing is drawn and matplotlib is not imported: the table alone costs next to
    nothing."""
    since_us = measure.history.started_us
    pickle_path = stem.with_name(stem.name + ".pickle")
    snapshot = measure.history.dump(pickle_path) if history else None
    written = report.write(stem)
    if snapshot is not None:
        written.append(pickle_path)
    line = build(report.stages, snapshot, since_us)
    rgb = None
    if picture:
        png = stem.with_name(stem.name + ".png")
        rgb = line.save(png)
        written.append(png)
    lines = [
        report.markdown() if report.stages else "no stage of the pack ran in this prompt (cached outputs?)"
    ]
    lines.append(f"peak allocated over the prompt: {format_bytes(report.peak_allocated)}")
    if line.peak is not None:
        lines.append(f"timeline: {line.peak.label()}")
    if not history:
        lines.append("no allocator history: not asked for")
    elif snapshot is None:
        problem = measure.history_problem()
        lines.append(
            f"{NO_CUDA}: no allocator snapshot"
            if problem == NO_CUDA
            else f"no allocator history: {problem or 'none was recorded in this prompt'}"
        )
    lines.append("files: " + ", ".join(p.name for p in written))
    return Record(written, rgb, "\n".join(lines))


def write_record(
    report: measure.MemoryReport, folder: Path, prefix: str, picture: bool = True, history: bool = True
) -> Record:
    """:func:`write_report` under the next free ``prefix_NNNNN`` name in ``folder``."""
    return write_report(report, outputs.next_stem(folder, prefix), picture, history)
