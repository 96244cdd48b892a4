"""Where a server prompt's sampling node spends its time, from ``warm.py --phases DIR`` (each prompt's
nodes, model loads and unloads, and transformer forwards timed in the server by ``benchmarks/prompt_profiler``).

For each row (one ``NAME.phases.jsonl``) and its later prompts (2-5, as warm.py's "later"), the means of:
the sampling node (KSampler or the Quanto PixArt Sampler); its part before the first forward, and the model
loads in it; the steps (first forward's call to last forward's return); the host's seconds inside the
forwards; the forwards' GPU seconds and the GPU's idle time between forwards (CUDA events: the time the GPU
waited for the host between one forward's end and the next one's start); the part after the last forward,
and the unloads in it.

    python benchmarks/phases.py DIR            a markdown table on stdout
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SAMPLING_NODES = ("KSampler", "PixArtQ_Sampler")
LATER = range(1, 5)  # prompts 2-5
COLUMNS = (
    ("node", "sampling node"),
    ("before", "before 1st forward"),
    ("loads", "loads in it"),
    ("steps", "steps"),
    ("forward_host", "host in forwards"),
    ("forward_gpu", "forwards' GPU"),
    ("gpu_idle", "GPU idle between forwards"),
    ("after", "after last forward"),
    ("unloads", "unloads in it"),
)


def prompt_phases(prompt: dict) -> dict | None:
    """One prompt's sampling node split into its phases, in ms (None: no sampling node or no forward)."""
    spans = prompt["spans"]
    nodes = [(s, e) for kind, label, s, e in spans if kind == "node" and label in SAMPLING_NODES]
    forwards = [(s, e) for kind, _label, s, e in spans if kind == "forward"]
    if len(nodes) != 1 or not forwards:
        return None
    (start, end), first, last = nodes[0], forwards[0][0], forwards[-1][1]

    def within(kind: str, low: float, high: float) -> float:
        return sum(e - s for k, _label, s, e in spans if k == kind and low <= s <= high)

    ms = {
        "node": end - start,
        "before": first - start,
        "loads": within("load", start, first),
        "steps": last - first,
        "forward_host": sum(e - s for s, e in forwards),
        "forward_gpu": sum(prompt.get("forward_gpu", [])) or None,
        "gpu_idle": sum(prompt.get("gpu_idle_between_forwards", [])) if "forward_gpu" in prompt else None,
        "after": end - last,
        "unloads": within("unload", last, end),
    }
    return {key: None if value is None else value * 1000 for key, value in ms.items()}


def table(folder: Path) -> str:
    lines = [
        "| row (later prompts, mean ms) | " + " | ".join(title for _key, title in COLUMNS) + " |",
        "| --- |" + " --- |" * len(COLUMNS),
    ]
    for path in sorted(folder.glob("*.phases.jsonl")):
        prompts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        phases = [p for p in (prompt_phases(x) for x in prompts if x["index"] in LATER) if p is not None]
        if not phases:
            continue
        cells = []
        for key, _title in COLUMNS:
            values = [p[key] for p in phases if p[key] is not None]
            cells.append(f"{statistics.mean(values):.1f}" if values else "–")
        lines.append(f"| {path.name.removesuffix('.phases.jsonl')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    print(table(parser.parse_args().folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
