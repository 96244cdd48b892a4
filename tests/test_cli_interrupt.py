"""Ctrl-C and a closed stdout, as a user's terminal delivers them: the command line says one line and no
traceback, whether the interrupt comes during the seconds of importing torch and diffusers or during
sampling, and leaves nothing partial behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pixart_lowvram.core import quant_cache

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGINT is a POSIX signal")


class Running:
    """The command line in a process of its own, its stderr read as it comes (tqdm's bars end in \\r,
    not in new lines); its stdout is not needed."""

    def __init__(self, *args: str, cwd: Path, python: tuple[str, ...] = ()):
        self.proc = subprocess.Popen(
            [sys.executable, *python, "-m", "pixart_lowvram", *args],
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # A pytest started in the background (`pytest &` in a script) ignores SIGINT, and so would its
            # children: the user's terminal gives the command line Python's own handling.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.err = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        # What has come so far, whole: no waiting for a full buffer or a new line.
        while chunk := os.read(self.proc.stderr.fileno(), 1 << 16):
            self.err += chunk.decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.err):
            assert self.proc.poll() is None, f"ended before {pattern!r}:\n{self.err}"
            assert time.monotonic() < deadline, f"no {pattern!r} in {timeout} s:\n{self.err}"
            time.sleep(0.05)

    def interrupt(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=120)
        self.reader.join(timeout=10)
        return self.err


def assert_interrupted(running: Running, err: str) -> None:
    # Killed by SIGINT, after one line: as Python ends on any Ctrl-C (a shell reports status 130), so a
    # shell script's loop stops too.
    assert running.proc.returncode == -signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().splitlines()[-1] == "interrupted", err


def test_ctrl_c_while_torch_and_diffusers_import(tiny_folder, tmp_path):
    # -X importtime logs each import as it completes: a torch module after the command line's own
    # module has loaded is the moment the heavy imports are under way.
    running = Running(
        "demo", "--model-dir", str(tiny_folder), "--out", str(tmp_path / "out"), "--device", "cpu",
        cwd=tmp_path, python=("-X", "importtime"),
    )  # fmt: skip
    running.wait_for(r"pixart_lowvram\.cli\.main\n(?:.*\n)*?.*\|\s+torch\b")
    err = running.interrupt()
    assert_interrupted(running, err)
    # (-X importtime logs the imports the interrupt unwound too, so their lines do not tell when it came.)
    assert "Loading weights" not in err, "the interrupt came after the imports"
    assert not (tmp_path / "out").exists()


def test_ctrl_c_while_sampling_leaves_nothing_behind(tiny_folder, tmp_path):
    out = tmp_path / "out"
    running = Running(
        "demo", "--model-dir", str(tiny_folder), "--out", str(out), "--device", "cpu", "--steps", "1000",
        cwd=tmp_path,
    )  # fmt: skip
    running.wait_for(r"sampling:.*\| [1-9]\d*/1000 ")  # a step done: the transformer is running
    err = running.interrupt()
    assert_interrupted(running, err)
    assert not out.exists() or not any(out.iterdir())
    assert not list(quant_cache.default_dir().glob("*.partial"))


def test_a_closed_stdout_ends_quietly(tmp_path):
    """``pixart-lowvram cache | head -1``: the reader is gone before the listing is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pixart_lowvram", "cache", "--dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 1
    assert err == ""
