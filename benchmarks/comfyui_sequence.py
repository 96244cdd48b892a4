"""The pack in a real ComfyUI server, step by step, with the server's device memory read after each step:
every bundled API workflow, two prompts with keep_loaded on every node, POST /free, a third prompt, Cancel
during sampling and a prompt after it, core VAELoader/VAEDecode beside the kept pack models, POST /free
again (the steps and criteria: tests/server_sequence.py, which tests/test_comfyui_gpu.py runs too).

Starts ComfyUI (``--comfyui``, default $COMFYUI_PATH) on 127.0.0.1 and a free port with the pack linked into
a fresh base directory (``--base``, default a new temporary folder), ``--model-dir`` linked into its
models/diffusers and the model's VAE written to its models/vae as ``sdxl_vae.safetensors`` (one file in the
original key layout, which core VAELoader reads). On the GPU unless ``--cpu``: the version's defaults, so
Dynamic VRAM is on where the version has it. Exit code 1 when a criterion fails, 2 when the sequence could
not run.

GPU run (full-size random weights), in the venv that has ComfyUI's requirements and the pack:

    python benchmarks/comfyui_sequence.py --comfyui /path/to/ComfyUI --model-dir pixart-full --size 1024

CPU run with the tiny model (the memory criterion does not apply there; ``--out`` elsewhere than the kept
result):

    python benchmarks/comfyui_sequence.py --comfyui /path/to/ComfyUI --cpu --model-dir tiny-pixart \\
        --size 64 --steps 2 --out seq-cpu
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import harness  # first: the tests' server support is importable once it is

# isort: split
from comfy_server import START_TIMEOUT, ServerError, started
from server_sequence import SDXL_VAE_FILE, Settings, run_sequence, write_sdxl_vae

from pixart_lowvram.cli import client as api

TITLE = "ComfyUI sequence"
MIB = 2**20
LOG_TAIL = 80
logger = logging.getLogger("comfyui_sequence")


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def markdown(result: dict) -> str:
    s, server, log = result["settings"], result["server"], result["log"]
    lines = [
        f"Model {s['model']}, {s['size']}², {s['steps']} steps (cancel: {s['cancel_steps']}); ComfyUI "
        f"{server.get('comfyui')}, torch {server.get('pytorch')}, device {server.get('device')}; "
        f"Dynamic VRAM: {log['dynamic_vram']}.",
        "",
        "| criterion | result | figures |",
        "| --- | --- | --- |",
    ]
    for check in result["checks"]:
        verdict = {True: "pass", False: "**FAIL**", None: "n/a"}[check["passed"]]
        lines.append(f"| {check['name']} | {verdict} | {check['detail']} |")
    lines += [
        "",
        "| step | result | seconds | allocated (MiB) | reserved (MiB) | free (MiB) | pack log | detail |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for step in result["steps"]:
        mem = step.get("memory") or {}
        counts = step["log"]
        pack_log = f"moved {counts['moved']}, reused {counts['reused']}, tracebacks {counts['tracebacks']}"
        detail = (
            step.get("error")
            or step.get("detail")
            or (f"{step['images']} image(s)" if "images" in step else "")
        )
        detail = detail.replace("|", "/").replace("\n", " ")[:300]
        lines.append(
            f"| {step['name']} | {'ok' if step['passed'] else '**FAILED**'} | {step['seconds']:.1f} "
            f"| {_mib(mem.get('allocated'))} | {_mib(mem.get('reserved'))} | {_mib(mem.get('free'))} "
            f"| {pack_log} | {detail} |"
        )
    lines += ["", "Dynamic VRAM / aimdo lines in the server log:", ""]
    lines += [f"    {line}" for line in log["dynamic_vram_lines"]] or ["    (none)"]
    if log["core_import_failures"]:
        lines += [
            "",
            "ComfyUI's own node modules that failed to import (their Tracebacks are not counted):",
            "",
        ]
        lines += [f"    {path}" for path in log["core_import_failures"]]
    if log["traceback_excerpts"]:
        lines += ["", f"Tracebacks ({log['tracebacks']}), the first ones:", ""]
        for excerpt in log["traceback_excerpts"]:
            lines += [f"    {line}" for line in excerpt.splitlines()] + [""]
    if log.get("tail"):
        lines += ["", f"Server log, last {LOG_TAIL} lines:", ""]
        lines += [f"    {line}" for line in log["tail"]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(__doc__, "comfyui_sequence", comfyui=True, size=512, steps=20)
    p.add_argument(
        "--python",
        default=os.environ.get("COMFYUI_PYTHON") or sys.executable,
        help="the interpreter that runs ComfyUI (default: $COMFYUI_PYTHON, else this one)",
    )
    p.add_argument("--model", help="the model's name on the server (default: --model-dir's folder name)")
    p.add_argument(
        "--vae-file", type=Path, help="an SDXL VAE .safetensors for core VAELoader (default: the model's VAE)"
    )
    p.add_argument("--cpu", action="store_true", help="start ComfyUI with --cpu (default: on the GPU)")
    p.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for ComfyUI, e.g. --server-arg=--disable-dynamic-vram (repeatable)",
    )
    p.add_argument("--base", type=Path, help="the server's base directory (default: a new temporary one)")
    p.add_argument("--cancel-steps", type=int, default=1000, help="steps of the prompt that is cancelled")
    p.add_argument("--limit-mib", type=float, default=64.0, help="allowed allocated difference after /free")
    p.add_argument("--prompt-timeout", type=float, default=600.0, help="seconds, for each prompt")
    p.add_argument("--free-timeout", type=float, default=120.0, help="seconds, for each /free to show")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT, help="seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = harness.parse(parser, argv, title=TITLE, render=markdown, required=("comfyui", "model_dir"))
    if not (args.model_dir / "model_index.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no model_index.json there")
    if args.size % 16:
        parser.error(f"--size {args.size}: must be a multiple of 16")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = Settings(
        model=args.model or args.model_dir.name,
        size=args.size,
        steps=args.steps,
        cancel_steps=args.cancel_steps,
        limit_mib=args.limit_mib,
        prompt_timeout=args.prompt_timeout,
        free_timeout=args.free_timeout,
    )
    base = (args.base or Path(tempfile.mkdtemp(prefix="comfyui-sequence-"))).resolve()
    try:
        write_sdxl_vae(args.model_dir, base / "models" / "vae" / SDXL_VAE_FILE, args.vae_file)
        with started(
            args.comfyui,
            base,
            {settings.model: args.model_dir},
            args.python,
            cpu=args.cpu,
            extra_args=tuple(args.server_args),
            timeout=args.start_timeout,
        ) as server:
            logger.info("ComfyUI at %s (pid %d), log %s", server.url, server.pid, server.log)
            result = run_sequence(server.url, server.log, settings)
    except (ServerError, api.ClientError) as exc:
        print(f"comfyui_sequence: {exc}", file=sys.stderr)
        return 2
    run = harness.run(parser, args, args.comfyui)
    result = harness.write(args, result, run=run, title=TITLE, render=markdown)
    print(harness.markdown_text(TITLE, result, markdown))
    return 0 if all(check["passed"] is not False for check in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
