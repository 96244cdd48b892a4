"""benchmarks/warm.py's prompt sequence for server rows: laps, a time limit that keeps whole laps, each lap's
image checked against its first, and interleaved rows compared prompt by prompt."""

from __future__ import annotations

import torch
import warm  # benchmarks/, on pytest's pythonpath


class Clock:
    """A fake ``time.time`` that the test moves on by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_without_a_limit_every_lap_runs():
    assert list(warm.laps_by(3)) == list(enumerate(warm.sequence(3)))
    assert len(warm.sequence(3)) == 6 + 4 + 4


def test_a_limit_keeps_whole_laps(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(warm.time, "time", clock)
    until = clock.now + 11  # at a second a prompt: the six, one lap of four (ends at 10), not the next (14)
    ran = []
    for index, item in warm.laps_by(5, until):
        ran.append((index, item))
        clock.now += 1.0
    assert ran == list(enumerate(warm.sequence(2)))


def test_the_first_lap_runs_whatever_the_limit(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(warm.time, "time", clock)
    ran = []
    for index, _item in warm.laps_by(3, clock.now - 1):
        ran.append(index)
        clock.now += 1.0
    assert ran == list(range(6))


def images(count: int) -> list[torch.Tensor]:
    """Images as a deterministic server gives them: one per prompt of the sequence, the same prompt the
    same image."""
    return [torch.full((2, 2, 3), float(warm.sequence(3).index(p))) for p in warm.sequence(3)[:count]]


def test_each_lap_is_checked_against_its_first():
    same = warm.result_of("server: pack defaults", [{}] * 14, images(14))
    assert same["repeat_identical"] and same["laps_identical"] and same["laps"] == 3
    cut = warm.result_of("server: pack defaults", [{}] * 10, images(10))
    assert cut["laps"] == 2 and cut["laps_identical"]
    changed = images(14)
    changed[12] = changed[12] + 1  # prompt 4 of the third lap differs from its first
    assert not warm.result_of("server: pack defaults", [{}] * 14, changed)["laps_identical"]
    single = warm.result_of("warm-up: fill the pre-quantized cache", [{}], images(1))
    assert single["repeat_identical"] and "laps" not in single


def test_interleaved_rows_are_compared_prompt_by_prompt():
    names = [
        "server: pack defaults",
        "server: ComfyUI core fp16 + Batched Guidance",
        "server: ComfyUI core fp16",
    ]
    seconds = {names[0]: 1.0, names[1]: 1.5, names[2]: 2.0}
    results = {}
    for name in names:
        records = [{"seconds": seconds[name] * (3 if i == 0 else 1)} for i in range(10)]
        results[name] = warm.result_of(name, records, images(10)) | {"interleaved": names}
        results[name]["summary"] = warm.summary(records, None)
    meta = {"device": "cpu", "torch": torch.__version__, "date": "today", "laps": 2}
    text = warm.markdown(meta, results)
    assert "Server rows interleaved: 3 servers up at once" in text
    assert f"- {names[1]} against {names[0]}: 1.500× (median 1.500×, 1.50–1.50×)" in text
    assert f"- {names[2]} against {names[0]}: 2.000×" in text
    assert f"- {names[1]} against {names[2]}: 0.750×" in text
    assert "then prompts 2–5 again, 2 laps in all" in text
