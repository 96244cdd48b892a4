"""Show that a change leaves every bundled workflow's image bit for bit.

Each API workflow in workflows/api/ runs on the CPU through a real ComfyUI server twice: with the pack as
it is at a git revision (``--base``) and with the pack of this working tree, uncommitted changes included.
Only the pack's code differs between the two: both servers read the same tiny random model (the demo's,
built once), the same SDXL VAE and LoRA files made from it, and get the same prompts — this working tree's
workflows pointed at the tiny model at its native size with few steps, as the comfyui tier points them
(``tiny_sets`` in tools/tiny_workflows.py), queued by the pack's API client (cli/client.py). The
saved PNGs are compared byte for byte, and pixel by pixel where the bytes differ.

    python tools/same_images.py --base main~5 [--comfyui PATH] [--python PATH]

The interpreter needs ComfyUI's requirements and the pack's: the comfyui tier's venv has both
(``bash .ci/comfyui`` builds it). From the repository root:

    ~/.cache/pixart-lowvram-ci/venv-v0.33.0-*/bin/python tools/same_images.py --base main

or run it with .venv's python and name the ComfyUI venv's interpreter for the servers with ``--python``.
``--comfyui`` defaults to the newest checkout in ../shared/comfyui beside the repository;
$COMFYUI_EXTRA_ARGS goes on the servers' command lines, as in the comfyui tier.

Prints one row per saved image: the workflow, the sha256 of each side's PNG (its first 16 hex digits) and
"same", or how the two differ. Exits 1 when any image differs or a workflow fails on either side, 2 when
the comparison cannot start. A workflow that needs node types neither server has is shown as skipped. The
base revision's files (``git archive``) and the servers' folders are in a temporary folder removed at the
end; each server keeps its pre-quantized weights there too, so each side quantizes with its own code.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
API_WORKFLOWS = REPO / "workflows" / "api"
COMFYUI_CHECKOUTS = REPO.parent / "shared" / "comfyui"
# The server support this script uses lives beside it (comfy_server.py, tiny_workflows.py, vae_layout.py),
# shared with the tests and the benchmarks; nothing here imports tests/.
TOOLS = Path(__file__).resolve().parent
SIDES = ("base", "working tree")
FOLDERS = ("base", "working_tree")  # each side's PNGs under --out
SHOWN_DIGITS = 16
# ComfyUI writes the prompt into each PNG, with each node's fingerprint (``is_changed``): Free VRAM's is
# the time it ran, so two runs of one workflow never give the same bytes. Without it a PNG holds the image
# alone, and the same bytes mean the same pixels, encoded the same way.
NO_METADATA = "--disable-metadata"

logger = logging.getLogger("same_images")


class CannotCompare(RuntimeError):
    """The comparison could not start or a server could not run; the message says why."""


# ---- arguments ------------------------------------------------------------------------------------


def version_of(checkout: Path) -> tuple[int, ...] | None:
    """The version a ComfyUI checkout's VERSION file names on its first line ("ComfyUI v0.8.0")."""
    try:
        first = (checkout / "VERSION").read_text(encoding="utf-8").splitlines()[0]
    except (OSError, IndexError):
        return None
    found = re.search(r"\d+(?:\.\d+)+", first)
    return tuple(map(int, found[0].split("."))) if found else None


def newest_checkout(root: Path) -> Path | None:
    """The checkout under ``root`` with the highest VERSION and a main.py; None when there is none."""
    found = [
        (version, folder)
        for folder in (root.iterdir() if root.is_dir() else ())
        if (folder / "main.py").is_file() and (version := version_of(folder)) is not None
    ]
    return max(found)[1] if found else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python tools/same_images.py",
        description="Run every bundled API workflow on the CPU through ComfyUI with the pack from a git "
        "revision and with the pack of this working tree, on the same tiny random model, and compare the "
        "saved PNGs byte for byte.",
    )
    parser.add_argument(
        "--base", required=True, help="the git revision to compare with, e.g. main~5 or a commit hash"
    )
    parser.add_argument(
        "--comfyui",
        type=Path,
        default=None,
        help=f"a ComfyUI checkout (default: the newest in {COMFYUI_CHECKOUTS.relative_to(REPO.parent)} "
        "beside the repository)",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter the servers run with: one with ComfyUI's requirements and the pack's "
        "(default: this one)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"keep each side's PNGs in this folder ({' and '.join(f + '/' for f in FOLDERS)}, a folder per "
        "workflow in each); without it they are removed with the temporary folder",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each prompt may take")
    args = parser.parse_args(argv)
    if args.comfyui is None:
        args.comfyui = newest_checkout(COMFYUI_CHECKOUTS)
        if args.comfyui is None:
            parser.error(
                f"no ComfyUI checkout (a folder with VERSION and main.py) in {COMFYUI_CHECKOUTS}; "
                "give one with --comfyui"
            )
    if not (args.comfyui / "main.py").is_file():
        parser.error(f"--comfyui {args.comfyui}: not a ComfyUI checkout (no main.py); give its folder")
    return args


# ---- comparing ------------------------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def difference(base: bytes, work: bytes) -> str:
    """``same`` when the two PNGs are the same bytes; else how they differ: size, pixels, or only the bytes
    (the same pixels, other metadata or encoding)."""
    if base == work:
        return "same"
    import numpy as np
    from PIL import Image

    images = []
    for data in (base, work):
        with Image.open(io.BytesIO(data)) as image:
            images.append((image.size, image.mode, np.asarray(image)))
    (base_size, base_mode, a), (work_size, work_mode, b) = images
    if (base_size, base_mode) != (work_size, work_mode):
        shapes = [f"{width}x{height} {mode}" for (width, height), mode, _ in images]
        return f"differs: {shapes[0]} vs {shapes[1]}"
    if np.array_equal(a, b):
        return "differs: same pixels, other bytes (metadata or encoding)"
    changed = np.any(a != b, axis=-1) if a.ndim == 3 else a != b
    largest = int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max())
    return f"differs: {int(changed.sum())} of {changed.size} pixels, by up to {largest}"


@dataclass
class Side:
    """What one server made of the workflows: each one's saved PNGs (in the order ComfyUI reports them),
    or why it did not run."""

    images: dict[str, list[bytes]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class Row:
    workflow: str
    base: str  # the sha256 of the base revision's PNG, or "-"
    work: str
    result: str

    @property
    def same(self) -> bool:
        return self.result == "same"

    @property
    def skipped(self) -> bool:
        return self.result.startswith("skipped")


def rows(names: list[str], base: Side, work: Side) -> list[Row]:
    """One row per saved image of each workflow (``name[k]`` when a workflow saves several), or one row
    saying why a workflow has no images to compare."""
    table = []
    for name in names:
        if name in base.skipped and name in work.skipped:
            table.append(Row(name, "-", "-", f"skipped: {base.skipped[name]}"))
            continue
        problems = [
            f"failed on the {side}: {outcome.failed.get(name) or outcome.skipped[name]}"
            for side, outcome in zip(SIDES, (base, work), strict=True)
            if name in outcome.failed or name in outcome.skipped
        ]
        if problems:
            table.append(Row(name, "-", "-", "; ".join(problems)))
            continue
        pairs = list(zip(base.images[name], work.images[name], strict=False))
        if len(base.images[name]) != len(work.images[name]) or not pairs:
            counts = f"{len(base.images[name])} vs {len(work.images[name])} saved images"
            table.append(Row(name, "-", "-", f"differs: {counts}"))
            continue
        for index, (a, b) in enumerate(pairs):
            label = name if len(pairs) == 1 else f"{name}[{index}]"
            table.append(Row(label, sha256(a), sha256(b), difference(a, b)))
    return table


def passed(table: list[Row]) -> bool:
    """Whether every image is the same (a workflow skipped on both sides has none to compare)."""
    return all(row.same or row.skipped for row in table)


def format_table(table: list[Row]) -> str:
    """The rows as aligned columns under a header, then one line counting them."""
    head = ("workflow", f"{SIDES[0]} sha256", f"{SIDES[1]} sha256", "result")
    lines = [head, *((r.workflow, r.base[:SHOWN_DIGITS], r.work[:SHOWN_DIGITS], r.result) for r in table)]
    widths = [max(len(line[column]) for line in lines) for column in range(3)]
    text = ["  ".join([*(line[c].ljust(widths[c]) for c in range(3)), line[3]]) for line in lines]
    same = sum(r.same for r in table)
    skipped = sum(r.skipped for r in table)
    summary = f"{same} of {len(table) - skipped} images the same"
    if skipped:
        summary += f"; {skipped} workflow(s) skipped"
    return "\n".join([*text, summary])


# ---- the two sides --------------------------------------------------------------------------------


def import_support(scratch: Path) -> None:
    """Make this working tree importable as ``pixart_lowvram`` (the repository root is the package), ahead
    of any installed copy, and the server support beside this script importable, whatever the
    interpreter."""
    link = scratch / "path" / "pixart_lowvram"
    link.parent.mkdir(parents=True)
    link.symlink_to(REPO, target_is_directory=True)
    sys.path[:0] = [str(link.parent), str(TOOLS)]


def base_tree(revision: str, target: Path) -> str:
    """The files of ``revision`` written to ``target`` (``git archive``); its commit hash."""
    found = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode != 0:
        raise CannotCompare(
            f"--base {revision!r} is not a commit of the repository at {REPO}; give a branch, a tag or a "
            "commit hash, e.g. main~5"
        )
    commit = found.stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True)
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(target, filter="data")
    return commit


def shared_files(workflows: dict[str, dict], folder: Path) -> dict[str, dict[str, Path]]:
    """What both servers read, made once: the tiny model (the demo's, in the pack's home folder), and for
    the file names the workflows ask for, the model's VAE as an SDXL VAE file (models/vae) and a random
    LoRA of its transformer (models/loras). Returns {models subfolder: {name: file or folder}}."""
    from safetensors.torch import load_file, save_file
    from tiny_workflows import LORA_SCALE, MODEL
    from vae_layout import to_original_layout

    from pixart_lowvram.cli.random_model import ensure_random_pixart, save_random_lora
    from pixart_lowvram.core import folders

    model = folders.home() / "random-tiny"
    logger.info("the tiny model: %s (built once, as the demo's)", model)
    ensure_random_pixart(model, "tiny")
    files: dict[str, dict[str, Path]] = {"diffusers": {MODEL: model}, "vae": {}, "loras": {}}
    for node in (node for workflow in workflows.values() for node in workflow.values()):
        inputs = node.get("inputs", {})
        if isinstance(inputs.get("vae_name"), str) and inputs["vae_name"] not in files["vae"]:
            path = folder / "vae" / inputs["vae_name"]
            path.parent.mkdir(parents=True, exist_ok=True)
            weights = load_file(model / "vae" / "diffusion_pytorch_model.safetensors")
            save_file(to_original_layout(weights), path)
            files["vae"][inputs["vae_name"]] = path
        if isinstance(inputs.get("lora_name"), str) and inputs["lora_name"] not in files["loras"]:
            path = folder / "loras" / inputs["lora_name"]
            files["loras"][inputs["lora_name"]] = save_random_lora(model, path, scale=LORA_SCALE)
    return files


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """``values`` set in this process's environment (which a server started meanwhile inherits), then
    put back."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_side(
    side: str,
    pack: Path,
    base: Path,
    files: dict[str, dict[str, Path]],
    workflows: dict[str, Path],
    downloads: Path,
    args: argparse.Namespace,
) -> Side:
    """Start a server with ``pack`` as its node pack, ``base`` as its base directory and the shared files
    linked into its models folder, queue each workflow once, and keep what it saved (its files under
    ``downloads``/workflow)."""
    import comfy_server
    from tiny_workflows import DISTRIBUTED, DISTRIBUTED_LINK, tiny_sets

    from pixart_lowvram.cli import client, commands
    from pixart_lowvram.core import folders, quant_cache

    for subfolder in ("vae", "loras"):
        for name, path in files[subfolder].items():
            (base / "models" / subfolder).mkdir(parents=True, exist_ok=True)
            (base / "models" / subfolder / name).symlink_to(path)
    custom_nodes = {comfy_server.PACK_LINK: pack}
    if (DISTRIBUTED / "__init__.py").is_file():  # what the distributed example workflow needs
        custom_nodes[DISTRIBUTED_LINK] = DISTRIBUTED
    home = base / "pixart_lowvram_home"
    outcome = Side()
    logger.info("%s: starting ComfyUI (%s) with the pack from %s", side, args.comfyui, pack)
    # The pack's home, its pre-quantized weights and matplotlib's caches in this server's folder.
    private = {
        folders.HOME_ENV: str(home),
        quant_cache.ENV: str(home / "quantized"),
        "MPLCONFIGDIR": str(home / "matplotlib"),
    }
    with (
        environment(**private),
        comfy_server.started(
            args.comfyui,
            base,
            models=files["diffusers"],
            python=args.python,
            cpu=True,
            custom_nodes=custom_nodes,
            pack=False,
            extra_args=(NO_METADATA,),
        ) as server,
    ):
        node_types = set(client.Client(server.url).get("/object_info"))
        for name, path in workflows.items():
            # The command line the comfyui tier gives ``queue``, read by the command line's own parser.
            line = commands.build_parser().parse_args(["queue", str(path), *tiny_sets(path)])
            workflow = commands.queued_workflow(line)
            missing = sorted({node["class_type"] for node in workflow.values()} - node_types)
            if missing:
                outcome.skipped[name] = f"the server has no node type {', '.join(missing)}"
                continue
            logger.info("%s: %s", side, name)
            try:
                (queued,) = client.queue(workflow, server.url, 1, downloads / name, args.timeout)
            except client.ClientError as exc:
                outcome.failed[name] = str(exc).splitlines()[0]
                logger.error(
                    "%s: %s failed: %s\nthe server log ends:\n%s", side, name, exc, server.log_tail()
                )
                continue
            outcome.images[name] = [file.read_bytes() for file in queued.files]
    return outcome


def compare(args: argparse.Namespace, scratch: Path) -> list[Row]:
    import_support(scratch)
    import comfy_server

    paths = sorted(API_WORKFLOWS.glob("*.json"))
    if not paths:
        raise CannotCompare(f"no API workflow in {API_WORKFLOWS}")
    workflows = {path.stem: path for path in paths}
    commit = base_tree(args.base, scratch / "base_pack")
    logger.info("base: %s = %s", args.base, commit)
    files = shared_files(
        {name: json.loads(path.read_text(encoding="utf-8")) for name, path in workflows.items()},
        scratch / "shared",
    )
    kept = args.out or scratch / "downloads"
    try:
        base = run_side(
            SIDES[0],
            scratch / "base_pack",
            scratch / "base_server",
            files,
            workflows,
            kept / FOLDERS[0],
            args,
        )
        work = run_side(SIDES[1], REPO, scratch / "work_server", files, workflows, kept / FOLDERS[1], args)
    except comfy_server.ServerError as exc:
        raise CannotCompare(str(exc)) from exc
    return rows(list(workflows), base, work)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="same_images-") as scratch:
        try:
            table = compare(args, Path(scratch))
        except CannotCompare as exc:
            logger.error("same_images: %s", exc)
            return 2
    print(format_table(table))
    return 0 if passed(table) else 1


if __name__ == "__main__":
    sys.exit(main())
