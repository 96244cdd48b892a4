"""The memory timeline: allocated/reserved rebuilt from an allocator snapshot, the peak and its stage, the
picture with and without CUDA history, and the report files of Memory Snapshot and the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fresh_python import probe
from PIL import Image

from pixart_lowvram.cli import main as cli
from pixart_lowvram.core import measure, timeline
from pixart_lowvram.core.measure import StageRecord

MiB = 2**20
T0 = 1_764_000_000_000_000  # µs since the epoch, as the trace's time_us
SEGMENT, OLD_SEGMENT = 0x7F0000000000, 0x7E0000000000


def event(action: str, addr: int, size: int, ms: float) -> dict:
    return {"action": action, "addr": addr, "size": size, "time_us": T0 + int(ms * 1000), "stream": 0}


def free(addr: int, size: int, ms: float) -> list[dict]:
    return [event("free_requested", addr, size, ms), event("free_completed", addr, size, ms + 0.001)]


# Before recording started, 1 MiB was allocated in a 2 MiB segment. Then, in ms since T0:
TRACE = [
    event("segment_alloc", SEGMENT, 20 * MiB, 100),
    event("alloc", SEGMENT, 8 * MiB, 100.01),  # 9 MiB allocated
    event("alloc", SEGMENT + 8 * MiB, 4 * MiB, 1000),  # 13
    *free(SEGMENT + 8 * MiB, 4 * MiB, 1500),  # 9
    event("alloc", SEGMENT + 8 * MiB, 10 * MiB, 3000),  # 19: the peak, in "sample"
    *free(SEGMENT + 8 * MiB, 10 * MiB, 3200),  # 9
    *free(SEGMENT, 8 * MiB, 4000),  # 1
    event("segment_free", SEGMENT, 20 * MiB, 4100),
    event("alloc", OLD_SEGMENT + MiB, MiB // 2, 4200),  # 1.5
    # Its free is requested but waits on another stream: allocated drops, the block is not reusable yet.
    event("free_requested", OLD_SEGMENT + MiB, MiB // 2, 4300),  # 1
    event("oom", 0, 64 * MiB, 4400),
]
# The allocator's state when the snapshot was taken.
SEGMENTS = [
    {
        "device": 0,
        "address": OLD_SEGMENT,
        "total_size": 2 * MiB,
        "allocated_size": MiB,
        "active_size": MiB + MiB // 2,
        "blocks": [
            {"address": OLD_SEGMENT, "size": MiB, "requested_size": MiB, "state": "active_allocated"},
            {
                "address": OLD_SEGMENT + MiB,
                "size": MiB // 2,
                "requested_size": MiB // 2,
                "state": "active_awaiting_free",
            },
            {
                "address": OLD_SEGMENT + 3 * MiB // 2,
                "size": MiB // 2,
                "requested_size": 0,
                "state": "inactive",
            },
        ],
    }
]
# Levels (MiB) before the first event and after each allocating/reserving one; the free_completed
# entries, and the oom, change neither.
TIMES_MS = [0, 100, 100.01, 1000, 1500, 3000, 3200, 4000, 4100, 4200, 4300]
ALLOCATED_MIB = [1, 1, 9, 13, 9, 19, 9, 1, 1, 1.5, 1]
RESERVED_MIB = [2, 22, 22, 22, 22, 22, 22, 22, 2, 2, 2]
STAGES = [
    StageRecord("t5_encode", "cuda:0", 1.6, started_us=T0 + 500_000, ended_us=T0 + 2_100_000),
    StageRecord("sample", "cuda:0", 1.6, started_us=T0 + 2_200_000, ended_us=T0 + 3_800_000),
]


def snapshot(trace=TRACE) -> dict:
    return {"segments": SEGMENTS, "device_traces": [list(trace)]}


def mib(values) -> list[float]:
    return [v / MiB for v in values]


def test_series_rebuilt_from_the_trace_and_the_state_at_dump():
    (series,) = timeline.device_series(snapshot(), since_us=T0)
    assert series.device == 0
    assert list(series.time_us) == [T0 + int(ms * 1000) for ms in TIMES_MS]
    assert mib(series.allocated) == ALLOCATED_MIB
    assert mib(series.reserved) == RESERVED_MIB


def test_series_survive_a_wrapped_ring_buffer():
    # max_entries reached: the oldest entries are gone; the levels after the kept ones are the same,
    # because the start level comes from the state at dump time.
    (series,) = timeline.device_series(snapshot(TRACE[3:]))
    assert mib(series.allocated) == [13, *ALLOCATED_MIB[4:]]
    assert mib(series.reserved) == [22, *RESERVED_MIB[4:]]


def test_events_before_this_run_set_the_start_level():
    since = T0 + 2_000_000  # an earlier run's events (before `since`) are not on this timeline
    (series,) = timeline.device_series(snapshot(), since_us=since)
    assert series.time_us[0] == since and series.time_us[1] == T0 + 3_000_000
    assert mib(series.allocated) == [9, *ALLOCATED_MIB[5:]]


def test_peak_value_time_and_stage():
    line = timeline.build(STAGES, snapshot(), since_us=T0)
    assert line.peak == timeline.Peak(19 * MiB, 22 * MiB, T0 + 3_000_000, 0, "sample")
    assert "19.0 MiB" in line.peak.label() and "in sample" in line.peak.label()


def test_peak_outside_every_stage_is_between_stages():
    early = [StageRecord("t5_encode", "cuda:0", 0.1, started_us=T0, ended_us=T0 + 50_000)]
    assert timeline.build(early, snapshot(), since_us=T0).peak.stage is None


def test_stages_on_another_clock_are_left_off():
    # e.g. stage times taken from a clock the trace does not use: the peak has no stage.
    shifted = [
        StageRecord(
            r.stage, r.device, r.seconds, started_us=r.started_us - 10**13, ended_us=r.ended_us - 10**13
        )
        for r in STAGES
    ]
    assert timeline._on_trace_clock(shifted, timeline.device_series(snapshot())) == []


def test_a_long_trace_is_plotted_from_a_bounded_number_of_points():
    rng = np.random.default_rng(0)
    n = 100_000
    steps = rng.integers(1, 64, n) * MiB
    trace, live = [event("segment_alloc", SEGMENT, 2**40, 0)], []
    for i, size in enumerate(steps):
        ms = 1 + i * 0.01
        if live and rng.random() < 0.5:
            addr, old = live.pop(rng.integers(len(live)))
            trace += free(addr, old, ms)
        else:
            addr = SEGMENT + i * 64 * MiB
            live.append((addr, int(size)))
            trace.append(event("alloc", addr, int(size), ms))
    # Everything still allocated at dump time is in one segment, as the trace says.
    segments = [
        {
            "device": 0,
            "address": SEGMENT,
            "total_size": 2**40,
            "blocks": [
                {"address": a, "size": s, "requested_size": s, "state": "active_allocated"} for a, s in live
            ],
        }
    ]
    shot = {"segments": segments, "device_traces": [trace]}
    line = timeline.build([], shot)
    (series,) = line.series
    assert series.allocated[0] == 0 and series.allocated[-1] == sum(s for _, s in live)
    assert line.peak.allocated == series.allocated.max()
    keep = timeline.envelope(len(series.time_us), [series.allocated, series.reserved])
    assert len(keep) <= timeline.MAX_PLOT_POINTS + 1
    assert np.argmax(series.allocated) in keep and np.argmin(series.allocated) in keep
    assert line.picture().shape == (500, 1000, 3)


def test_picture_with_history(tmp_path):
    line = timeline.build(STAGES, snapshot(), since_us=T0)
    picture = line.save(tmp_path / "t.png")
    assert picture.dtype == np.uint8 and picture.shape == (500, 1000, 3)
    with Image.open(tmp_path / "t.png") as saved:
        assert np.array_equal(np.asarray(saved.convert("RGB")), picture)
    # The peak marker is drawn in matplotlib's tab:red.
    red = (picture[..., 0] > 200) & (picture[..., 1] < 60) & (picture[..., 2] < 60)
    assert red.sum() > 20


def test_picture_without_history_shows_the_stages():
    cpu_stages = [
        StageRecord("t5_encode", "cpu", 1.0, started_us=T0, ended_us=T0 + 1_000_000),
        StageRecord("sample", "cpu", 2.0, started_us=T0 + 1_000_000, ended_us=T0 + 3_000_000),
    ]
    line = timeline.build(cpu_stages, None)
    assert line.series == [] and line.peak is None
    with_stages, without = line.picture(), timeline.build([], None).picture()
    assert with_stages.shape == without.shape == (500, 1000, 3)
    # Bars for the stages: green (tab:green) pixels, absent from the picture of no stages.
    green = (with_stages[..., 1] > 140) & (with_stages[..., 0] < 80) & (with_stages[..., 2] < 80)
    assert green.sum() > 1000
    assert not ((without[..., 1] > 140) & (without[..., 0] < 80) & (without[..., 2] < 80)).any()


def test_stage_records_carry_times_on_the_trace_clock():
    report = measure.MemoryReport()
    before = measure.trace_clock_us()
    with measure.stage("t5_encode", "cpu", report):
        pass
    (record,) = report.stages
    assert before <= record.started_us <= record.ended_us <= measure.trace_clock_us()
    assert json.loads(json.dumps(report.to_dict()))["stages"][0]["started_us"] == record.started_us


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: no allocator history")
def test_write_record_without_cuda(tmp_path):
    report = measure.MemoryReport()
    with measure.stage("t5_encode", "cpu", report):
        pass
    record = timeline.write_record(report, tmp_path / "out", "pixart_memory")
    names = sorted(p.name for p in record.files)
    assert names == ["pixart_memory_00001.json", "pixart_memory_00001.md", "pixart_memory_00001.png"]
    assert all(p.parent == tmp_path / "out" for p in record.files)
    with Image.open(tmp_path / "out" / "pixart_memory_00001.png") as png:
        assert png.size == (record.picture.shape[1], record.picture.shape[0])
    assert "t5_encode" in record.summary and measure.NO_CUDA in record.summary
    assert "pixart_memory_00001.png" in record.summary
    assert (
        timeline.write_record(report, tmp_path / "out", "pixart_memory")
        .files[0]
        .name.startswith("pixart_memory_00002")
    )


def test_no_history_under_cuda_malloc_async(tmp_path, monkeypatch, caplog):
    """ComfyUI starts PyTorch with the cudaMallocAsync allocator, which keeps no history and raises when
    asked for one: the snapshot is skipped with the reason and the fix, the report is still written."""

    def refuse(*args, **kwargs):
        raise RuntimeError("cudaMallocAsync does not yet support recordHistory")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse)
    history = measure.History()
    assert history.ensure("prompt-1") is False
    assert "--disable-cuda-malloc" in caplog.text
    caplog.clear()
    assert history.ensure("prompt-2") is False
    assert caplog.text == ""  # said once a process
    monkeypatch.setattr(measure, "history", history)
    report = measure.MemoryReport()
    report.add(StageRecord(stage="sample", device="cuda:0", seconds=1.0, peak_allocated=MiB))
    record = timeline.write_record(report, tmp_path, "pixart_memory")
    assert "no allocator history: PyTorch's cudaMallocAsync allocator keeps none" in record.summary
    assert "--disable-cuda-malloc" in record.summary
    assert sorted(p.suffix for p in record.files) == [".json", ".md", ".png"]


def test_write_record_without_the_picture_writes_the_table_only(tmp_path, monkeypatch):
    """Memory Snapshot with allocator_history off: the stage table alone, nothing drawn, no history asked."""

    def no_drawing(*args, **kwargs):
        raise AssertionError("the picture was drawn")

    def no_history(*args, **kwargs):
        raise AssertionError("the allocator history was dumped")

    monkeypatch.setattr(timeline.Timeline, "picture", no_drawing)
    monkeypatch.setattr(measure.history, "dump", no_history)
    report = measure.MemoryReport()
    report.add(
        StageRecord(stage="sample", device="cuda:0", seconds=1.0, peak_allocated=MiB, peak_reserved=MiB)
    )
    record = timeline.write_record(report, tmp_path, "pixart_memory", picture=False, history=False)
    assert record.picture is None
    assert sorted(p.name for p in record.files) == ["pixart_memory_00001.json", "pixart_memory_00001.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "pixart_memory_00001.json",
        "pixart_memory_00001.md",
    ]
    assert "| sample |" in record.summary and "no allocator history: not asked for" in record.summary
    assert "files: pixart_memory_00001.json, pixart_memory_00001.md" in record.summary


def test_history_off_leaves_a_recording_alone(tmp_path, monkeypatch):
    """A snapshot node that does not ask neither dumps nor stops a recording another one asked for."""
    recording = measure.History()
    recording.run_id = "prompt-1"
    monkeypatch.setattr(measure, "history", recording)
    record = timeline.write_record(
        measure.MemoryReport(), tmp_path, "pixart_memory", picture=True, history=False
    )
    assert recording.run_id == "prompt-1"
    assert sorted(p.suffix for p in record.files) == [".json", ".md", ".png"]
    assert record.picture is not None


def test_history_stop_forgets_the_recording(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: calls.append(kwargs))
    history = measure.History()
    history.stop()
    assert calls == []  # not recording: nothing to stop
    history.run_id = "prompt-1"
    history.stop()
    assert calls == [{"enabled": None}] and history.run_id is None


# A fresh interpreter: the table alone must not import matplotlib (its import alone takes a tenth of a
# second or more).
TABLE_ONLY = """
import json, sys, time
from pathlib import Path
from pixart_lowvram.core import measure, timeline

report = measure.MemoryReport()
with measure.stage("t5_encode", "cpu", report):
    pass
start = time.perf_counter()
record = timeline.write_record(report, Path(sys.argv[1]), "pixart_memory", picture=False, history=False)
print(json.dumps({
    "seconds": time.perf_counter() - start,
    "files": sorted(p.name for p in record.files),
    "matplotlib": sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib"),
}))
"""


def test_the_table_alone_does_not_import_matplotlib(tmp_path):
    result = probe(TABLE_ONLY, str(tmp_path / "out"), cwd=tmp_path)
    assert result["matplotlib"] == []
    assert result["files"] == ["pixart_memory_00001.json", "pixart_memory_00001.md"]
    assert result["seconds"] < 0.5, result  # next to nothing; generous for a loaded machine


@pytest.mark.parametrize("prefix", ["../escape", "a/b", "/abs", ".hidden", ""])
def test_report_names_cannot_leave_the_folder(tmp_path, prefix):
    folder = tmp_path / "out"
    with pytest.raises(ValueError, match="filename_prefix"):
        timeline.write_record(measure.MemoryReport(), folder, prefix)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == []


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_cli_writes_the_memory_report_beside_the_image(tiny_folder, tmp_path, capsys, command):
    out = tmp_path / "out"
    model = ["--model-dir", str(tiny_folder)] if command == "demo" else ["--model", str(tiny_folder)]
    argv = [command, *model, "--out", str(out), "--steps", "2", "--device", "cpu", "--no-quant-cache"]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    for name in (
        "pixart_00001.png",
        "pixart_00001_memory.png",
        "pixart_00001_memory.md",
        "pixart_00001_memory.json",
    ):
        assert (out / name).is_file(), name
        assert str(out / name) in stdout
    with Image.open(out / "pixart_00001_memory.png") as picture:
        assert picture.size == (1000, 500)
    stages = json.loads((out / "pixart_00001_memory.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["t5_encode", "sample", "vae_decode"]
    assert all(s["started_us"] <= s["ended_us"] for s in stages)
    if not torch.cuda.is_available():
        assert not (out / "pixart_00001_memory.pickle").exists()
