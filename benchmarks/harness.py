"""What every benchmark here shares: the stamp of a run, its result (NAME.json, and NAME.md made from it),
the common command-line arguments, the prompts, GPU memory watched per process, and the folder for
profiler traces (benchmarks/traces/, which git ignores).

A benchmark keeps one result, benchmarks/results/NAME.json: one run, one commit, one machine. A run
replaces it whole; its history is the file's (``git log -p benchmarks/results/NAME.json``).

The stamp names the files that ran by their git tree hash, computed from the files themselves as ``git
write-tree`` would for this working tree (the files git would track: those .gitignore does not exclude), so
a copy of the tree without ``.git`` is stamped the same. Where the history is at hand the stamp also names
the commit whose tree that is, or says that none is (uncommitted changes).

Server support (tools/comfy_server.py) is importable once this module is.

    python benchmarks/harness.py    # the stamp a run here would record, as JSON
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TRACES = REPO / "benchmarks" / "traces"
TOOLS = REPO / "tools"
if str(TOOLS) not in sys.path:
    sys.path.append(str(TOOLS))

GIB = 2**30
SIZE, STEPS, CFG = 1024, 20, 4.5
# The prompts of the benchmarks that run a few, each with its seed.
PROMPTS = [
    ("a photo of a red cat sitting in a sunlit garden, detailed fur", 0),
    ("a lighthouse on a rocky coast at dusk, waves, long exposure", 1),
    ("a bowl of ramen with a soft egg, studio lighting, top view", 2),
    ("an astronaut riding a horse across a desert, cinematic", 3),
    ("a watercolour painting of a snowy mountain village", 4),
]
MODEL_HELP = (
    "a diffusers PixArt-Σ folder (the full-size architecture with random weights: python -m pixart_lowvram "
    "demo --preset full --model-dir pixart-full --device cuda --steps 1)"
)


# ---- the stamp --------------------------------------------------------------------------------------


def ignore_patterns(root: Path) -> list[str]:
    source = root / ".gitignore"
    lines = source.read_text(encoding="utf-8").splitlines() if source.is_file() else []
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(relative: str, is_dir: bool, patterns: list[str]) -> bool:
    """Whether git would ignore ``relative`` (a path under the root, '/'-separated) by these .gitignore
    patterns: a pattern with a slash inside or in front matches the whole path from the root, one without
    matches a name at any depth; a trailing slash matches folders only. Negations are not used here."""
    name = relative.rsplit("/", 1)[-1]
    for pattern in patterns:
        if pattern.endswith("/"):
            if not is_dir:
                continue
            pattern = pattern[:-1]
        if "/" in pattern:
            if fnmatch.fnmatchcase(relative, pattern.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def tree_hash(root: Path = REPO) -> str:
    """The git tree hash of the files under ``root`` that git would track (``git add -A; git write-tree``),
    computed from the files alone: blobs and trees hashed as git hashes them."""
    patterns = ignore_patterns(root)

    def obj(kind: str, data: bytes) -> bytes:
        return hashlib.sha1(f"{kind} {len(data)}\0".encode() + data).digest()

    def tree(folder: Path, prefix: str) -> bytes | None:
        entries = []
        for path in folder.iterdir():
            relative = prefix + path.name
            if path.name == ".git" or ignored(relative, path.is_dir() and not path.is_symlink(), patterns):
                continue
            if path.is_symlink():
                entries.append((path.name, "120000", obj("blob", os.readlink(path).encode())))
            elif path.is_dir():
                sub = tree(path, relative + "/")
                if sub is not None:  # git keeps no empty folders
                    entries.append((path.name + "/", "40000", sub))
            else:
                mode = "100755" if os.access(path, os.X_OK) else "100644"
                entries.append((path.name, mode, obj("blob", path.read_bytes())))
        if not entries:
            return None
        entries.sort(key=lambda entry: entry[0].encode())  # a folder sorts as its name and "/", as in git
        data = b"".join(f"{m} {n.rstrip('/')}".encode() + b"\0" + digest for n, m, digest in entries)
        return obj("tree", data)

    found = tree(Path(root), "")
    return (found or obj("tree", b"")).hex()


def git(*args: str) -> str | None:
    """``git args`` in this repository, its output; None where there is no git or no history."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit_of(tree: str) -> dict:
    """The commit whose tree is ``tree`` (the oldest, on any branch), or why none is named."""
    history = git("log", "--all", "--reverse", "--format=%H %T")
    if history is None:
        return {"commit": None, "commit_note": "no git history here to look the tree up in"}
    for line in history.splitlines():
        commit, _, its_tree = line.partition(" ")
        if its_tree == tree:
            return {"commit": commit, "commit_note": "the commit whose tree ran"}
    return {"commit": None, "commit_note": "no commit has this tree: the run had uncommitted changes"}


def comfyui_version(comfyui: Path | None) -> str | None:
    """The version of the ComfyUI checkout ``comfyui`` (its comfyui_version.py), None without one."""
    if comfyui is None:
        return None
    source = Path(comfyui) / "comfyui_version.py"
    if source.is_file():
        found = re.search(r"__version__\s*=\s*[\"']([^\"']+)", source.read_text(encoding="utf-8"))
        if found:
            return found[1]
    version = Path(comfyui) / "VERSION"
    return version.read_text(encoding="utf-8").strip() if version.is_file() else None


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def stamp(comfyui: Path | None = None, packages: tuple[str, ...] = ()) -> dict:
    """What a run measured and on what: the tree (and its commit), the UTC date, the GPU (its name, memory
    and UUID, or "cpu"), Python, torch, diffusers, transformers, where a ComfyUI checkout is used its
    version, and the version of each of ``packages`` the benchmark names."""
    import torch

    tree = tree_hash()
    gpu = {"gpu": "cpu", "gpu_memory_gib": None, "gpu_uuid": None}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        gpu = {
            "gpu": properties.name,
            "gpu_memory_gib": round(properties.total_memory / GIB, 1),
            "gpu_uuid": str(getattr(properties, "uuid", "")) or None,
        }
    return {
        "tree": tree,
        **commit_of(tree),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": package_version("diffusers"),
        "transformers": package_version("transformers"),
        "comfyui": comfyui_version(comfyui),
        **({"packages": {name: package_version(name) for name in packages}} if packages else {}),
    }


def stamp_line(stamp: dict) -> str:
    """One line for a Markdown head: date, GPU, commit (or tree), versions."""
    gpu = stamp.get("gpu") or "GPU not recorded"
    if stamp.get("gpu_memory_gib"):
        gpu += f" ({stamp['gpu_memory_gib']:g} GiB)"
    ran = f"commit {stamp['commit'][:10]}" if stamp.get("commit") else f"tree {stamp['tree'][:10]}"
    versions = ", ".join(
        f"{label} {stamp[key]}"
        for key, label in (
            ("torch", "torch"),
            ("diffusers", "diffusers"),
            ("transformers", "transformers"),
            ("comfyui", "ComfyUI"),
            ("python", "Python"),
        )
        if stamp.get(key)
    )
    versions += "".join(f", {name} {version}" for name, version in (stamp.get("packages") or {}).items())
    return f"{str(stamp.get('date', '?'))[:10]}, {gpu}, {ran}; {versions}."


# ---- arguments ----------------------------------------------------------------------------------------


def parser(doc: str, name: str, *, comfyui: bool = False) -> argparse.ArgumentParser:
    """The benchmark's command line with the arguments they share: ``--model-dir``, ``--out``, ``--render``,
    and the ComfyUI checkout where asked."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(benchmark=name)
    p.add_argument("--model-dir", type=Path, help=MODEL_HELP)
    if comfyui:
        p.add_argument(
            "--comfyui",
            type=Path,
            default=os.environ.get("COMFYUI_PATH"),
            help="a ComfyUI checkout, used in place (default: $COMFYUI_PATH)",
        )
    p.add_argument(
        "--out", type=Path, default=RESULTS, help=f"the folder for {name}.json and {name}.md (%(default)s)"
    )
    p.add_argument("--render", action="store_true", help=f"write {name}.md again from {name}.json, and stop")
    return p


def parse(
    p: argparse.ArgumentParser,
    argv: list[str] | None = None,
    *,
    title: str = "",
    render: Callable[[dict], str] | None = None,
) -> argparse.Namespace:
    """The parsed arguments; with ``--render`` the Markdown is written again from the JSON and the process
    ends."""
    args = p.parse_args(argv)
    if args.render and render is not None:
        print(rewrite_markdown(args.out, args.benchmark, title, render))
        raise SystemExit(0)
    return args


# An absolute path inside a string: a slash that does not continue a word, a name or a URL, then two
# or more parts.
ABSOLUTE_PATH = re.compile(r"(?<![\w.:])(?<!:/)/(?:[^\s/:'\"]+/)+([^\s/:'\"]+)")


def portable(value: object) -> object:
    """``value`` as a results file records it: every absolute path in it as its last part (a results
    file names no machine's folders), paths as strings, tuples as lists."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return ABSOLUTE_PATH.sub(r"\1", value)
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [portable(item) for item in value]
    return value


def recorded(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The arguments a run was given, less the internal ones and those about where the result goes."""
    hidden = {a.dest for a in p._actions if a.help == argparse.SUPPRESS} | {"render", "out", "benchmark"}
    return {key: portable(value) for key, value in vars(args).items() if key not in hidden}


def command(argv: list[str] | None = None) -> str:
    """This process's command line as a results file records it."""
    argv = sys.argv if argv is None else argv
    words = [str(portable(word)) for word in argv[1:]]
    return shlex.join(["python", f"benchmarks/{Path(argv[0]).name}", *words])


# ---- results ------------------------------------------------------------------------------------------


def load(out: Path, name: str) -> dict | None:
    path = Path(out) / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def run(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    comfyui: Path | None = None,
    packages: tuple[str, ...] = (),
) -> dict:
    """This run as its result records it: the stamp, the arguments and the command line."""
    return {"stamp": stamp(comfyui, packages), "arguments": recorded(p, args), "command": command()}


def write(args: argparse.Namespace, data: dict, *, run: dict, title: str, render: Callable) -> dict:
    """NAME.json in ``args.out`` (``data`` with the ``run`` that measured it, replacing what was there) and
    NAME.md made from it."""
    result = {"benchmark": args.benchmark, **run, **portable(data)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{args.benchmark}.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (Path(args.out) / f"{args.benchmark}.md").write_text(
        markdown_text(title, result, render), encoding="utf-8"
    )
    return result


def markdown_text(title: str, result: dict, render: Callable[[dict], str]) -> str:
    """A result's Markdown: the title, the stamp, the command and the benchmark's own tables."""
    head = stamp_line(result["stamp"]) + (f" `{result['command']}`" if result.get("command") else "")
    return f"# {title}\n\n{head}\n\n{render(result).rstrip()}\n"


def rewrite_markdown(out: Path, name: str, title: str, render: Callable[[dict], str]) -> str:
    """NAME.md again from NAME.json."""
    result = load(out, name)
    if result is None:
        raise SystemExit(f"--render: no {name}.json in {out}")
    text = markdown_text(title, result, render)
    (Path(out) / f"{name}.md").write_text(text, encoding="utf-8")
    return text


def traces(name: str) -> Path:
    """The folder for a benchmark's profiler dumps and traces (ignored by git)."""
    folder = TRACES / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ---- measuring ---------------------------------------------------------------------------------------


def save_png(image, path: Path) -> float:
    """Write ``image`` ([B, C, H, W] in 0..1) as ComfyUI's SaveImage writes it (8-bit PNG, compress level 4)
    to ``path``; the seconds it took."""
    import numpy as np
    from PIL import Image

    start = time.perf_counter()
    for index, picture in enumerate(image):
        pixels = (picture.permute(1, 2, 0).numpy() * 255.0).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path.with_suffix(f".{index}.png"), compress_level=4)
    return time.perf_counter() - start


class GpuWatch:
    """GPU memory in use while it is entered, polled every 10 ms through NVML: ``peak`` of the processes
    ``pids`` together (what the card gives them: their CUDA contexts, torch's and any other allocator's
    memory) and ``card_peak`` of the whole card; both None where NVML cannot tell (no NVIDIA GPU, no
    pynvml, or per-process figures withheld)."""

    def __init__(self, pids: list[int]):
        self.pids, self.peak, self.card_peak = set(pids), None, None
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._device = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML: nothing to watch
            self._nvml = None

    def own_now(self) -> int | None:
        """What ``pids`` hold on the card now; None where NVML cannot tell."""
        if self._nvml is None:
            return None
        try:
            return self.read()[0]
        except self._nvml.NVMLError:
            return None

    def read(self) -> tuple[int | None, int]:
        processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._device)
        used = [p.usedGpuMemory for p in processes if p.pid in self.pids]
        own = sum(used) if used and None not in used else None
        return own, self._nvml.nvmlDeviceGetMemoryInfo(self._device).used

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                own, card = self.read()
            except self._nvml.NVMLError:  # figures withheld: the peaks stay as far as they were read
                return
            if own is not None:
                self.peak = max(self.peak or 0, own)
            self.card_peak = max(self.card_peak or 0, card)
            self._stop.wait(0.01)

    def __enter__(self):
        self._thread = None
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def card_free() -> int | None:
    """The whole card's free memory now (NVML), None without NVML."""
    watch = GpuWatch([])
    try:
        return None if watch._nvml is None else watch._nvml.nvmlDeviceGetMemoryInfo(watch._device).free
    except watch._nvml.NVMLError:
        return None


# ---- tables and workflows --------------------------------------------------------------------------


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    """A Markdown table's lines."""
    cells = [[str(c).replace("|", "/").replace("\n", " ") for c in row] for row in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in cells]


def gib(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value / GIB:.{digits}f}"


def without(workflow: dict, kinds: tuple[str, ...]) -> dict:
    """An API workflow without its nodes of ``kinds``, each link to one of them taken by what fed the
    node's first linked input (a pass-through node: Memory Snapshot, a LoRA loader). A link to another
    output of a dropped node cannot be kept: ValueError."""
    dropped = {key: node for key, node in workflow.items() if node["class_type"] in kinds}
    kept = {key: node for key, node in workflow.items() if key not in dropped}
    for node in kept.values():
        for name, value in node["inputs"].items():
            while isinstance(value, list) and value[0] in dropped:
                if value[1] != 0:
                    raise ValueError(
                        f"input {name} takes output {value[1]} of {dropped[value[0]]['class_type']}, which "
                        "is left out; leave the node in"
                    )
                value = next(v for v in dropped[value[0]]["inputs"].values() if isinstance(v, list))
            node["inputs"][name] = value
    return kept


if __name__ == "__main__":
    print(json.dumps(stamp(), indent=1))
