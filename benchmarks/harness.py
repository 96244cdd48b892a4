"""What every benchmark here shares: the stamp of a run (the commit it measured and whether the tree had
uncommitted changes, the date, the GPU, the library versions), its result written as NAME.json with the
Markdown table made from it as NAME.md, the common command-line arguments, the prompts, and the folder for
profiler traces (benchmarks/traces/, which git ignores).

A benchmark keeps one result, benchmarks/results/NAME.json, which each run replaces: its history is the
file's (``git log -p benchmarks/results/NAME.json``). A benchmark whose runs may measure some of its rows
(``--only``) merges instead: the rows a run measures replace those of the same name, the others stay, and
each row names the run that measured it (``runs``, oldest first).

Where the tree is a copy (a GPU machine that receives the working tree), the commit comes from
``$PIXART_LOWVRAM_BENCH_COMMIT`` and whether it had uncommitted changes from ``$PIXART_LOWVRAM_BENCH_DIRTY``
(1 or 0), set where the copy was made; set, they win over a ``.git`` the copy may carry (an older one
than its files).

The tests' server support (tests/comfy_server.py, tests/server_sequence.py) is importable once this module
is: the benchmarks start and drive ComfyUI servers as the tests do.

    python benchmarks/harness.py                # the stamp a run here would record, as JSON
    python benchmarks/harness.py --self-check   # merging, paths and Markdown checked, no GPU needed
"""

from __future__ import annotations

import argparse
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
TESTS = REPO / "tests"
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))

GIB = 2**30
SIZE, STEPS, CFG = 1024, 20, 4.5
# The prompts of the benchmarks that run several, each with its seed.
PROMPTS = [
    ("a photo of a red cat sitting in a sunlit garden, detailed fur", 0),
    ("a lighthouse on a rocky coast at dusk, waves, long exposure", 1),
    ("a bowl of ramen with a soft egg, studio lighting, top view", 2),
    ("an astronaut riding a horse across a desert, cinematic", 3),
    ("a watercolour painting of a snowy mountain village", 4),
]
PROMPT = PROMPTS[0][0]
MODEL_HELP = (
    "a diffusers PixArt-Σ folder (the full-size architecture with random weights: python -m pixart_lowvram "
    "demo --preset full --model-dir pixart-full --device cuda --steps 2)"
)
COMMIT_VARIABLE, DIRTY_VARIABLE = "PIXART_LOWVRAM_BENCH_COMMIT", "PIXART_LOWVRAM_BENCH_DIRTY"


# ---- the stamp --------------------------------------------------------------------------------------


def git(*args: str) -> str | None:
    """``git args`` in this repository, its output; None where there is no git or no checkout."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def checkout() -> dict:
    """The commit the tree is at and whether its tracked files differ from it: from the environment where
    ``$PIXART_LOWVRAM_BENCH_COMMIT`` is set (a copy of the tree), else from git."""
    given = os.environ.get(COMMIT_VARIABLE)
    commit = None if given else git("rev-parse", "HEAD")
    if commit:
        status = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": commit, "dirty": None if status is None else bool(status)}
    dirty = os.environ.get(DIRTY_VARIABLE)
    return {
        "commit": given,
        "dirty": None if dirty is None else dirty not in ("0", ""),
        "commit_note": f"from ${COMMIT_VARIABLE}, set where the tree was copied"
        if given
        else f"not known: the tree was not a git checkout and ${COMMIT_VARIABLE} was not set",
    }


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
    """What a run measured and on what: the commit, the UTC date, the GPU (its name and memory, or "cpu"),
    Python, torch, diffusers, transformers, where a ComfyUI checkout is used its version, and the version
    of each of ``packages`` the benchmark names."""
    import torch

    gpu, memory, count = "cpu", None, 0
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        gpu, memory, count = (
            properties.name,
            round(properties.total_memory / GIB, 1),
            torch.cuda.device_count(),
        )
    return {
        **checkout(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "gpu_memory_gib": memory,
        "gpu_count": count,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": package_version("diffusers"),
        "transformers": package_version("transformers"),
        "comfyui": comfyui_version(comfyui),
        **({"packages": {name: package_version(name) for name in packages}} if packages else {}),
    }


def stamp_line(stamp: dict) -> str:
    """One line for a Markdown head: date, GPU, commit, versions."""
    gpu = stamp.get("gpu") or "GPU not recorded"
    if stamp.get("gpu_count", 1) and stamp.get("gpu_count", 1) > 1:
        gpu = f"{stamp['gpu_count']} × {gpu}"
    if stamp.get("gpu_memory_gib"):
        gpu += f" ({stamp['gpu_memory_gib']:g} GiB)"
    commit = (stamp.get("commit") or "unknown")[:10]
    tree = {True: "with uncommitted changes", False: "clean", None: "changes not recorded"}[
        stamp.get("dirty")
    ]
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
    return f"{str(stamp.get('date', '?'))[:10]}, {gpu}, commit {commit} ({tree}); {versions}."


# ---- arguments ----------------------------------------------------------------------------------------


def parser(
    doc: str,
    name: str,
    *,
    model_dir: bool = True,
    comfyui: bool = False,
    size: int | None = None,
    steps: int | None = None,
    only: bool = False,
) -> argparse.ArgumentParser:
    """The benchmark's command line with the arguments they share: ``--out``, ``--name`` and ``--render``
    always; the model folder, the ComfyUI checkout, the image size, the steps and ``--only`` (rows by name)
    where asked."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(benchmark=name)
    if model_dir:
        p.add_argument("--model-dir", type=Path, help=MODEL_HELP)
    if comfyui:
        p.add_argument(
            "--comfyui",
            type=Path,
            default=os.environ.get("COMFYUI_PATH"),
            help="a ComfyUI checkout, used in place (default: $COMFYUI_PATH)",
        )
    if size is not None:
        p.add_argument("--size", type=int, default=size, help="image width and height in px (%(default)s)")
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help="sampling steps (%(default)s)")
    if only:
        p.add_argument(
            "--only", action="append", default=[], metavar="ROW", help="a row by name (repeatable)"
        )
    p.add_argument(
        "--out", type=Path, default=RESULTS, help="the folder for NAME.json and NAME.md (benchmarks/results)"
    )
    p.add_argument("--name", default=name, help="the result's name (%(default)s)")
    p.add_argument(
        "--render", action="store_true", help="write NAME.md again from NAME.json in --out, and stop"
    )
    return p


def parse(
    p: argparse.ArgumentParser,
    argv: list[str] | None = None,
    *,
    title: str = "",
    render: Callable[[dict], str] | None = None,
    required: tuple[str, ...] = (),
) -> argparse.Namespace:
    """The parsed arguments; with ``--render`` the Markdown is written again from the JSON and the process
    ends. ``required``: arguments (by their dest) a measuring run needs."""
    args = p.parse_args(argv)
    if args.render:
        if render is None:
            p.error(f"{args.benchmark} has no Markdown to render")
        print(rewrite_markdown(args.out, args.name, title, render))
        raise SystemExit(0)
    for dest in required:
        if getattr(args, dest, None) is None:
            p.error(f"give --{dest.replace('_', '-')}")
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
    words = []
    for word in argv[1:]:
        option, equals, value = word.partition("=")
        words.append(
            f"{option}={portable(value)}" if equals and value.startswith("/") else str(portable(word))
        )
    script = Path(argv[0])
    return shlex.join(["python", f"benchmarks/{script.name}", *words])


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


def write(
    args: argparse.Namespace,
    data: dict,
    *,
    run: dict,
    title: str,
    render: Callable[[dict], str],
    merge: str | None = None,
) -> dict:
    """NAME.json in ``args.out`` (``data`` with the ``run`` that measured it) and NAME.md made from it.
    ``merge``: the key of ``data`` (name: row) whose rows join those already there (see the module's doc)."""
    result = {"benchmark": args.benchmark, **run, **portable(data)}
    if merge:
        result |= merged(load(args.out, args.name), result[merge], run, merge)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (Path(args.out) / f"{args.name}.md").write_text(markdown_text(title, result, render), encoding="utf-8")
    return result


def merged(previous: dict | None, rows: dict, run: dict, key: str = "rows") -> dict:
    """``runs`` and ``key``: the previous result's rows that ``rows`` does not measure again, each with its
    run, then (in the previous order, new names last) the rows of this ``run``. The runs keep their order
    (this one last), so a row's run number changes only where an earlier run no longer names a row."""
    previous = previous or {}
    # A result written without runs was measured by one: its own stamp's.
    alone = {key: previous[key] for key in ("stamp", "arguments", "command") if key in previous}
    runs = previous.get("runs") or [alone]
    kept = {name: dict(row) for name, row in previous.get(key, {}).items()}
    for row in kept.values():
        row["run"] = runs[row.get("run", 0)]
    kept |= {name: {**row, "run": run} for name, row in rows.items()}
    named = [row["run"] for row in kept.values()]
    ordered: list[dict] = []
    for each in runs:  # the previous runs that still name a row, in their order; this run last
        if each != run and each in named and each not in ordered:
            ordered.append(each)
    ordered += [run] if run in named else []
    for row in kept.values():
        row["run"] = ordered.index(row["run"])
    return {"runs": ordered, key: kept}


def head(result: dict) -> str:
    """The Markdown head of a result: its stamp, or each run's where its rows come from several."""
    runs = result.get("runs")
    if not runs:
        line = stamp_line(result["stamp"])
        return line + (f" `{result['command']}`" if result.get("command") else "")
    lines = ["Each row names the run that measured it:", ""]
    for index, run in enumerate(runs):
        line = f"{index + 1}. {stamp_line(run['stamp'])}"
        line += f" `{run['command']}`" if run.get("command") else ""
        lines.append(line + (f" {run['note'][0].upper()}{run['note'][1:]}." if run.get("note") else ""))
    return "\n".join(lines)


def run_of(result: dict, row: dict) -> str:
    """A row's run as its table cell: the run's number in the head's list."""
    return str(row["run"] + 1) if isinstance(row.get("run"), int) else "–"


def markdown_text(title: str, result: dict, render: Callable[[dict], str]) -> str:
    """A result's Markdown: the title, the stamp (or the runs) and the benchmark's own tables."""
    return f"# {title}\n\n{head(result)}\n\n{render(result).rstrip()}\n"


def rewrite_markdown(out: Path, name: str, title: str, render: Callable[[dict], str]) -> str:
    """NAME.md again from NAME.json (a result kept from an earlier run, or one whose table changed)."""
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


def png_seconds(image) -> float:
    """Seconds to write ``image`` ([B, C, H, W] in 0..1) as ComfyUI's SaveImage writes it (8-bit PNG,
    compress level 4): what a server prompt pays on top of the generation, for the anchor's side of the
    comparison (not in the anchor's seconds)."""
    import io

    import numpy as np
    from PIL import Image

    start = time.perf_counter()
    for picture in image:
        pixels = (picture.permute(1, 2, 0).numpy() * 255.0).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(io.BytesIO(), format="PNG", compress_level=4)
    return time.perf_counter() - start


class CardUsed:
    """The whole card's used memory (``cudaMemGetInfo``, what NVML's "used" reads: every process and
    context, the server's and this client's), polled every 10 ms while it is entered; ``peak`` in bytes."""

    def __init__(self, enabled: bool = True):
        self.peak, self._stop, self.enabled = 0, threading.Event(), enabled

    def _poll(self) -> None:
        import torch

        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            self._stop.wait(0.01)

    def __enter__(self):
        if not self.enabled:
            self._stop.set()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


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


class SelfCheckFailed(AssertionError):
    """A self-check found the merging, the paths or the Markdown not as they must be."""


def self_check() -> list[str]:
    """What the results files rely on, without a GPU: the names of the checks, each raising
    :class:`SelfCheckFailed` where it fails."""
    import tempfile

    def expect(condition: bool, what: str) -> None:
        if not condition:
            raise SelfCheckFailed(what)

    done = []
    first = {"stamp": {"commit": "a" * 40, "date": "2026-01-01"}, "arguments": {}}
    second = {"stamp": {"commit": "b" * 40, "date": "2026-01-02"}, "arguments": {"only": ["y"]}}
    result = {"stamp": first["stamp"], "arguments": {}, **merged(None, {"x": {"v": 1}, "y": {"v": 2}}, first)}
    expect(result["runs"] == [first] and {r["run"] for r in result["rows"].values()} == {0}, f"{result}")
    again = merged(result, {"y": {"v": 3}}, second)
    expect(again["runs"] == [first, second], f"runs {again['runs']}")
    expect(again["rows"] == {"x": {"v": 1, "run": 0}, "y": {"v": 3, "run": 1}}, f"rows {again['rows']}")
    done.append("a run replaces the rows it measured and keeps the others with their runs")
    replaced = merged({**again, "stamp": second["stamp"]}, {"x": {"v": 4}, "y": {"v": 5}}, second)
    expect(replaced["runs"] == [second], f"a run no row names stayed: {replaced['runs']}")
    expect(merged(replaced, {"x": {"v": 6}}, second)["runs"] == [second], "the same run was counted twice")
    done.append("a run no row names goes, and writing one run twice keeps one")
    alone = merged(
        {"stamp": first["stamp"], "arguments": {}, "rows": {"x": {"v": 1}}}, {"y": {"v": 2}}, second
    )
    expect(alone["runs"][0]["stamp"] == first["stamp"] and alone["rows"]["x"]["run"] == 0, f"{alone}")
    done.append("a result written without runs keeps its stamp for its rows")
    third = {"stamp": {"commit": "c" * 40, "date": "2026-01-03"}, "arguments": {}}
    three_rows = {"runs": [first, second], "rows": {**again["rows"], "z": {"v": 7, "run": 0}}}
    kept_order = merged(three_rows, {"x": {"v": 8}}, third)
    expect(kept_order["runs"] == [first, second, third], f"runs {kept_order['runs']}")
    numbers = {name: row["run"] for name, row in kept_order["rows"].items()}
    expect(numbers == {"x": 2, "y": 1, "z": 0}, f"{numbers}")
    done.append("the runs keep their order when a run replaces the first rows")
    paths = {
        "/tmp/a/b/server": "server",
        "--base-directory=/home/x/y": "--base-directory=y",
        "sqlite:////tmp/x/db.sqlite": "sqlite:///db.sqlite",
        "http://127.0.0.1:8188/view": "http://127.0.0.1:8188/view",
        "workflows/api/x.json": "workflows/api/x.json",
    }
    for given, kept in paths.items():
        expect(portable(given) == kept, f"portable({given!r}) is {portable(given)!r}, not {kept!r}")
    expect(portable({"a": [Path("/x/y/z"), ("/p/q",)]}) == {"a": ["z", ["q"]]}, "portable of nested values")
    done.append("a results file names no machine's folders")
    with tempfile.TemporaryDirectory() as folder:
        args = argparse.Namespace(out=Path(folder), name="check", benchmark="harness")

        def render(result: dict) -> str:
            return "\n".join(
                table(
                    ["row", "run", "v"], [[n, run_of(result, r), r["v"]] for n, r in result["rows"].items()]
                )
            )

        run1 = {"stamp": first["stamp"], "arguments": {}, "command": "python benchmarks/harness.py"}
        write(args, {"rows": {"x": {"v": 1}}}, run=run1, title="Check", render=render, merge="rows")
        written = write(
            args, {"rows": {"y": {"v": 2}}}, run=second, title="Check", render=render, merge="rows"
        )
        text = (Path(folder) / "check.md").read_text(encoding="utf-8")
        expect(
            text == rewrite_markdown(Path(folder), "check", "Check", render), "--render gave other Markdown"
        )
        expect("| x | 1 | 1 |" in text and "| y | 2 | 2 |" in text and "2. 2026-01-02" in text, text)
        expect(written["stamp"] == second["stamp"], "the result's stamp is not its last run's")
    done.append("NAME.md is made from NAME.json, the same again with --render")
    return done


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-check"]:
        for name in self_check():
            print(f"ok: {name}")
    else:
        print(json.dumps(stamp(), indent=1))
