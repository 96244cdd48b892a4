"""benchmarks/warm.py's prompt sequence for server rows: rounds, a time limit that keeps whole rounds, each
round's image checked against its first, and interleaved rows compared prompt by prompt. The benchmark
checks these itself (``--self-check``, no GPU or server needed); this runs that check in a subprocess, as the
tests import nothing from benchmarks/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WARM = Path(__file__).resolve().parents[1] / "benchmarks" / "warm.py"
CHECKS = (
    "without a limit every round runs",
    "a limit keeps whole rounds",
    "the first round runs whatever the limit",
    "each round is checked against its first",
    "interleaved rows are compared prompt by prompt",
)


@pytest.fixture(scope="module")
def self_check() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(WARM), "--self-check"], capture_output=True, text=True, timeout=300, check=False
    )


def test_the_self_check_passes(self_check):
    assert self_check.returncode == 0, self_check.stdout + self_check.stderr


@pytest.mark.parametrize("check", CHECKS)
def test_each_check_ran(self_check, check):
    assert f"ok: {check}" in self_check.stdout.splitlines(), self_check.stdout + self_check.stderr
