"""A ComfyUI server on the loopback interface for the tests, the benchmarks and tools/same_images.py:
started with the pack linked into a fresh base directory, or an already running one named by URL (loopback
hosts only), the resident memory of its process tree and the host's CPU time during a prompt.

Nothing here imports ComfyUI: the server runs in its own interpreter (``python`` below, ComfyUI's venv).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import requests

REPO = Path(__file__).resolve().parents[1]
PACK_LINK = "comfyui-pixart-lowvram"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
START_TIMEOUT = 300.0  # seconds; a cold start on a small CPU machine takes 20-40 s
STOP_GRACE = 20.0


class ServerError(RuntimeError):
    """The server could not be started, reached or measured; the message says why."""


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash, refused unless it is http:// on a loopback host."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or parts.hostname not in LOOPBACK or parts.port is None:
        raise ServerError(
            f"--server {url!r}: the benchmarks talk to a ComfyUI on this machine only; "
            f"give http://HOST:PORT with HOST one of {', '.join(LOOPBACK)}"
        )
    return f"http://{parts.netloc}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    pid: int
    base: Path | None = None  # the base directory, when started here
    log: Path | None = None

    def log_tail(self, lines: int = 80) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _stop(process: subprocess.Popen) -> None:
    """Terminate the server's process group (ComfyUI may start helpers), killing after a grace period."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_GRACE)


def _wait_until_up(process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(
                f"ComfyUI exited with code {process.returncode} while starting; its log:\n"
                + log.read_text(errors="replace")[-8000:]
            )
        try:
            if requests.get(url + "/system_stats", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise ServerError(f"ComfyUI did not answer {url}/system_stats within {timeout:g} s; its log: {log}")


def link_custom_node(source: Path, target: Path) -> None:
    """Another node pack, used in place: ``target`` is a folder of this base directory whose every entry
    links to the entry of ``source`` of the same name. The pack's code is ``source``'s, and what it writes
    beside its code of its own accord (ComfyUI-Distributed keeps its gpu_config.json there) lands in
    ``target``, one per server, not in ``source`` (which may be read-only, and shared by several servers)."""
    source = source.resolve()
    if not (source / "__init__.py").is_file():
        raise ServerError(f"{source} is not a ComfyUI node pack (no __init__.py)")
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.name in (".git", "__pycache__") or (target / entry.name).exists():
            continue
        (target / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


@contextlib.contextmanager
def started(
    comfyui: Path,
    base: Path,
    models: dict[str, Path],
    python: str,
    cpu: bool = False,
    extra_args: tuple[str, ...] = (),
    timeout: float = START_TIMEOUT,
    custom_nodes: dict[str, Path] | None = None,
    pack: bool = True,
    env: dict[str, str] | None = None,
    launch: tuple[str, ...] = (),
) -> Iterator[Server]:
    """ComfyUI from the checkout ``comfyui`` on 127.0.0.1 and a free port, with ``base`` as its base
    directory: custom_nodes/ links to this repository (unless ``pack`` is False) and holds each of
    ``custom_nodes`` (NAME: folder, see ``link_custom_node``), models/diffusers/NAME links to each of
    ``models``.
    $COMFYUI_EXTRA_ARGS (split as a shell would) goes last on its command line, e.g. ``--disable-api-nodes
    --front-end-root DIR`` where ComfyUI's front-end and API-node packages are not installed. ``env`` adds
    to the server's environment; ``launch`` goes between the interpreter and main.py (a script that
    starts main.py itself).
    The server (its whole process group) is stopped on exit; its log is ``base``/server.log."""
    comfyui = Path(comfyui).resolve()
    if not (comfyui / "main.py").is_file():
        raise ServerError(f"{comfyui} is not a ComfyUI checkout (no main.py); give --comfyui or COMFYUI_PATH")
    for folder in ("custom_nodes", "models/diffusers", "output", "input", "temp"):
        (base / folder).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_LINK
    if pack and not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    for name, folder in (custom_nodes or {}).items():
        link_custom_node(Path(folder), base / "custom_nodes" / name)
    for name, folder in models.items():
        target = base / "models" / "diffusers" / name
        if not target.exists():
            target.symlink_to(Path(folder).resolve(), target_is_directory=True)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = base / "server.log"
    command = [
        python,
        *launch,
        "main.py",
        "--listen",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-directory",
        str(base),
        "--database-url",
        f"sqlite:///{base / 'db.sqlite'}",
        "--disable-auto-launch",
        *(["--cpu"] if cpu else []),
        *extra_args,
        *shlex.split(os.environ.get("COMFYUI_EXTRA_ARGS", "")),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            command, cwd=comfyui, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_until_up(process, url, log, timeout)
        yield Server(url=url, pid=process.pid, base=base, log=log)
    finally:
        _stop(process)


# ---- host memory and CPU time of the server ---------------------------------------------------


def _proc_children(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _proc_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a zombie has no VmRSS


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            process = psutil.Process(pid)
            total = process.memory_info().rss
            for child in process.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += child.memory_info().rss
            return total
        except psutil.NoSuchProcess as exc:
            raise ServerError(f"the server process {pid} is gone") from exc
    try:
        total = _proc_rss(pid)
    except OSError as exc:
        raise ServerError(f"the server process {pid} is gone (/proc/{pid}: {exc})") from exc
    for child in _proc_children(pid):
        with contextlib.suppress(OSError):
            total += _proc_rss(child)
    return total


def cpu_ticks(pid: int) -> tuple[list[int], int] | None:
    """The machine's CPU time so far in clock ticks (``/proc/stat``'s first line: user, nice, system, idle,
    iowait, irq, softirq, steal) and the server process's own (``/proc/PID/stat``'s utime and stime; its
    threads, not its children); None where there is no /proc."""
    try:
        machine = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return machine, int(own[11]) + int(own[12])
    except (OSError, ValueError, IndexError):
        return None


def host_share(before, after) -> dict | None:
    """What the host did during a prompt, from two :func:`cpu_ticks` readings: the share of all CPUs' time the
    hypervisor gave to others (steal) and that was busy (not idle or iowait), and the server's CPU seconds.
    A gauge of the host's speed: the same prompt's work on a host that is slower for it."""
    if before is None or after is None:
        return None
    delta = [b - a for a, b in zip(before[0], after[0], strict=True)]
    total = sum(delta) or 1
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "steal": delta[7] / total,
        "busy": 1 - (delta[3] + delta[4]) / total,
        "server_cpu_seconds": (after[1] - before[1]) / ticks,
    }


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rpartition(":")[2], 16) == port:  # 0A: LISTEN
                    inodes.add(inode)
    return inodes


def listening_pid(port: int) -> int | None:
    """The process (of this user) listening on TCP ``port``, or None when it cannot be seen."""
    inodes = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(entry.name)
    return None
