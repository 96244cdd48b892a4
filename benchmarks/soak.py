"""Load and soak: N prompts of the bundled basic API workflow through a real ComfyUI, one after another,
with the server's host memory and allocated GPU memory measured after each.

Starts ComfyUI (``--comfyui``, default $COMFYUI_PATH) on 127.0.0.1 and a free port with the pack linked into
a fresh base directory and ``--model-dir`` linked into its models/diffusers, or attaches to a running one
(``--server``, loopback only). Prompts go through the pack's own client (``cli/client.py``, as
``python -m pixart_lowvram queue`` uses it); each prompt's T5 text and seed differ, so every node runs every
time. Bounded: ``--count`` prompts, ``--max-seconds`` in all, ``--prompt-timeout`` each.

After each prompt it records
  * host memory: the resident set of the server's process tree (psutil, else /proc);
  * allocated GPU memory as the server sees it: ComfyUI's /system_stats gives, for a CUDA device,
    ``torch_vram_total`` = the caching allocator's reserved bytes and ``torch_vram_free`` = reserved - active
    bytes, so their difference is torch's active bytes (allocated bytes plus blocks freed but still awaiting
    another stream's work; the two are equal once a prompt has finished). The Memory Snapshot node's JSON
    (fetched through /view) adds ``start_allocated`` of each prompt's first stage:
    ``torch.cuda.memory_allocated`` itself, read before the prompt's first stage, i.e. after the previous
    prompt. Both series are checked.
After the last prompt a Free VRAM prompt (on the last prompt's decode, its nodes cached) reports how many kept
models were left, and memory is read again.

Criteria (exit code 1 when one fails, 2 when the soak could not run):
  * every prompt succeeded, one image each;
  * GPU (CUDA only): allocated memory after each prompt within ``--gpu-limit-mib`` (64) of the level before
    the first (with ``--keep-loaded``: of the level after the first, the kept models included), and within
    that of the level before the first after Free VRAM;
  * host: RSS after the last prompt at most ``--host-limit`` % (5) above RSS after prompt ``--host-from`` (10);
  * without ``--keep-loaded``: no kept model left.

GPU run (full-size random weights, 512², 50 prompts), in the venv that has ComfyUI's requirements and the
pack; the first command builds the published PixArt-Σ 1024 shapes with random weights (about 10 GB):

    python -m pixart_lowvram demo --preset full --model-dir pixart-full --device cuda --steps 2
    python benchmarks/soak.py --comfyui /path/to/ComfyUI --model-dir pixart-full

(``--random-preset full`` builds the model in ``--model-dir`` when it is missing, without the demo run.)
CPU run with the tiny model (``--out`` elsewhere than the kept result):

    python benchmarks/soak.py --comfyui /path/to/ComfyUI --cpu --random-preset tiny \\
        --model-dir pixart-tiny --size 64 --steps 2 --count 50 --out soak-cpu

Writes ``soak.json`` and ``soak.md`` to ``--out`` (benchmarks/results), the images to ``--work``/images; a
started server's base directory (its output folder, memory reports and server.log) is ``--work``/server
unless ``--base`` says. ``--judge SOAK.json`` judges a soak's recorded figures again with this command's
criteria, without a server: it prints them as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import harness  # first: tools/ (comfy_server) is importable once it is

# isort: split
import comfy_server
from comfy_server import ServerError

from pixart_lowvram.cli import client as api

TITLE = "Soak"
WORKFLOW = harness.REPO / "workflows" / "api" / "pixart_lowvram_basic_api.json"
T5, SAMPLER, SNAPSHOT = "PixArtQ_T5Encode", "PixArtQ_Sampler", "PixArtQ_MemorySnapshot"
MIB = 2**20
DECODE, FREE_VRAM = "PixArtQ_VAEDecode", "PixArtQ_FreeVRAM"

logger = logging.getLogger("soak")


# ---- the prompts ----------------------------------------------------------------------------------


def build_prompts(args: argparse.Namespace, model: str) -> list[dict]:
    workflow = api.load_workflow(args.workflow)
    for node in workflow.values():
        inputs = node.get("inputs", {})
        if "model" in inputs:
            inputs["model"] = model
        if "keep_loaded" in inputs:
            inputs["keep_loaded"] = args.keep_loaded
        if node["class_type"] == SAMPLER:
            inputs.update(width=args.size, height=args.size, steps=args.steps)
    if args.no_snapshot:
        try:
            workflow = harness.without(workflow, (SNAPSHOT,))
        except ValueError as exc:
            raise api.ClientError(f"--no-snapshot: {exc}") from exc
    workflow = api.apply_overrides(workflow, args.sets)
    prompts = api.expand(workflow, args.count)
    if not args.same_text:
        for index, prompt in enumerate(prompts, 1):
            for node in prompt.values():
                if node["class_type"] == T5:
                    node["inputs"]["prompt"] = f"{node['inputs']['prompt']}, variation {index}"
    return prompts


# ---- what the server holds ------------------------------------------------------------------------


def device_stats(client: api.Client) -> dict:
    stats = client.get("/system_stats")
    device = dict(stats["devices"][0])
    if device.get("type") == "cuda":
        device["allocated"] = device["torch_vram_total"] - device["torch_vram_free"]
    else:
        device["allocated"] = None  # the CPU: /system_stats reports the machine's RAM there
    return device


def snapshot_stages(client: api.Client, entry: dict, workflow: dict) -> list[dict] | None:
    """The stage records of the prompt's Memory Snapshot JSON (None without a snapshot node)."""
    keys = [key for key, node in workflow.items() if node["class_type"] == SNAPSHOT]
    if not keys:
        return None
    text = "\n".join(entry.get("outputs", {}).get(keys[0], {}).get("text", []))
    files = next((line[len("files: ") :] for line in text.splitlines() if line.startswith("files: ")), "")
    names = [name for name in files.split(", ") if name.endswith(".json")]
    if len(names) != 1 or len(PurePosixPath(names[0]).parts) != 1:
        raise api.ClientError(f"the Memory Snapshot node did not name its JSON file: {text[-500:]!r}")
    response = client.session.get(
        client.url + "/view",
        params={"filename": names[0], "subfolder": "", "type": "output"},
        timeout=client.timeout,
    )
    if not response.ok:
        raise api.ClientError(f"GET /view {names[0]} answered {response.status_code}")
    return response.json()["stages"]


def kept_models_prompt(last: dict) -> dict:
    """Free VRAM on the last prompt's decode: its model nodes, with the same inputs, come from ComfyUI's cache
    (nothing loads or runs again), and with them in the prompt ComfyUI keeps holding the pack's models (a
    prompt of core nodes alone would let them go as it starts, and Free VRAM would find none)."""
    models = {key: node for key, node in last.items() if node["class_type"] in (T5, SAMPLER, DECODE)}
    decode = next(key for key, node in models.items() if node["class_type"] == DECODE)
    return copy.deepcopy(models) | {"free": {"class_type": FREE_VRAM, "inputs": {"value": [decode, 0]}}}


def kept_models(client: api.Client, ws, timeout: float, last: dict) -> int:
    """How many kept models Free VRAM dropped after the ``last`` prompt (:func:`kept_models_prompt`)."""
    prompt_id = str(uuid.uuid4())
    client.submit(kept_models_prompt(last), prompt_id)
    entry = client.wait(ws, prompt_id, timeout, "free VRAM")
    if (entry.get("status") or {}).get("status_str") != "success":
        raise api.ClientError(api.failure_text(prompt_id, entry))
    text = "\n".join(entry["outputs"]["free"]["text"])
    if not text.startswith("dropped ") or " kept model(s)" not in text:
        raise api.ClientError(f"Free VRAM answered {text!r}")
    return int(text.split()[1])


# ---- the run --------------------------------------------------------------------------------------


def soak(args: argparse.Namespace, url: str, pid: int, model: str) -> dict:
    prompts = build_prompts(args, model)
    client = api.Client(url)
    client.check(prompts[0])
    deadline = time.monotonic() + args.max_seconds
    images_dir = args.work / "images"
    result: dict = {
        "settings": {
            "model": model,
            "size": args.size,
            "steps": args.steps,
            "count": args.count,
            "keep_loaded": args.keep_loaded,
            "snapshot": not args.no_snapshot,
            "sets": args.sets,
            "max_seconds": args.max_seconds,
        },
        "server": {"url": url, "pid": pid},
        "prompts": [],
        "errors": [],
    }
    system = client.get("/system_stats")["system"]
    result["server"].update(
        comfyui=system.get("comfyui_version"), pytorch=system.get("pytorch_version"), argv=system.get("argv")
    )
    before = device_stats(client)
    result["before"] = {"rss": comfy_server.tree_rss(pid), **before}
    result["server"]["device"] = before.get("name")
    ws = client.connect()
    started = time.monotonic()
    last = prompts[0]  # the last prompt submitted: Free VRAM's prompt reuses its cached model nodes
    try:
        for index, prompt in enumerate(prompts, 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result["errors"].append(
                    f"--max-seconds {args.max_seconds:g} reached after {index - 1} prompt(s)"
                )
                break
            prompt_id, record = str(uuid.uuid4()), {"index": index}
            clock = time.monotonic()
            try:
                last = prompt
                outcome = client.run(
                    ws,
                    prompt,
                    images_dir,
                    min(args.prompt_timeout, remaining),
                    f"prompt {index}/{len(prompts)}",
                    prompt_id=prompt_id,
                )
                record["images"] = len(outcome.files)
                stages = snapshot_stages(client, outcome.entry, prompt)
                if stages is not None:
                    record["stages"] = stages
                    record["start_allocated"] = stages[0]["start_allocated"] if stages else None
            except api.ClientError as exc:
                record["error"] = str(exc)
                result["errors"].append(f"prompt {index}: {exc}")
            record["seconds"] = round(time.monotonic() - clock, 3)
            record["prompt_id"] = prompt_id
            record["rss"] = comfy_server.tree_rss(pid)
            record["allocated"] = device_stats(client)["allocated"]
            result["prompts"].append(record)
            logger.info(
                "prompt %d: %s, %.1f s, RSS %.1f MiB%s",
                index,
                "failed" if "error" in record else f"{record['images']} image(s)",
                record["seconds"],
                record["rss"] / MIB,
                "" if record["allocated"] is None else f", allocated {record['allocated'] / MIB:.1f} MiB",
            )
        result["seconds"] = round(time.monotonic() - started, 1)
        try:
            result["kept_models"] = kept_models(client, ws, args.prompt_timeout, last)
        except api.ClientError as exc:
            result["kept_models"] = None
            result["errors"].append(f"Free VRAM: {exc}")
        result["after_free"] = {
            "rss": comfy_server.tree_rss(pid),
            "allocated": device_stats(client)["allocated"],
        }
    finally:
        if ws is not None:
            ws.close()
    return result


# ---- criteria -------------------------------------------------------------------------------------


def _deviation(values: list[int], reference: int) -> int:
    return max(abs(value - reference) for value in values)


def judge(result: dict, args: argparse.Namespace) -> list[dict]:
    """Each criterion: name, passed (True, False, or None when it does not apply), and the figures."""
    prompts, limit = result["prompts"], args.gpu_limit_mib * MIB
    succeeded = [p for p in prompts if "error" not in p]
    images = sum(p.get("images", 0) for p in prompts)
    checks = [
        {
            "name": "every prompt succeeded, one image each",
            "passed": len(succeeded) == args.count and images == args.count,
            "detail": f"{len(succeeded)} of {args.count} prompts succeeded, {images} images received",
        }
    ]

    before = result["before"]["allocated"]
    done = [p for p in prompts if p["allocated"] is not None]
    if before is None or not done:
        checks.append({"name": "GPU allocated memory returns", "passed": None, "detail": "no CUDA device"})
    else:
        after = [p["allocated"] for p in done]
        reference, since = (after[0], "after prompt 1") if args.keep_loaded else (before, "before prompt 1")
        deviation = _deviation(after, reference)
        detail = (
            f"/system_stats: before prompt 1 {before / MIB:.1f} MiB, after each prompt "
            f"{min(after) / MIB:.1f}-{max(after) / MIB:.1f} MiB; max deviation from {since} "
            f"{deviation / MIB:.1f} MiB"
        )
        passed = deviation <= limit
        starts = [p.get("start_allocated") for p in prompts if p.get("start_allocated") is not None]
        if len(starts) >= 2:
            ref = starts[1] if args.keep_loaded else starts[0]
            snap = _deviation(starts[1:], ref)
            passed = passed and snap <= limit
            detail += (
                f"; Memory Snapshot start_allocated (after the previous prompt) max deviation "
                f"{snap / MIB:.1f} MiB"
            )
        freed = result.get("after_free", {}).get("allocated")
        if freed is not None:
            passed = passed and abs(freed - before) <= limit
            detail += f"; after Free VRAM {freed / MIB:.1f} MiB"
        checks.append(
            {
                "name": f"GPU allocated memory within {args.gpu_limit_mib} MiB",
                "passed": passed,
                "detail": detail,
                "max_deviation_mib": round(deviation / MIB, 2),
            }
        )

    host = {"name": f"host RSS growth from prompt {args.host_from} to the last ≤ {args.host_limit:g} %"}
    if len(prompts) <= args.host_from:
        host |= {
            "passed": False,
            "detail": f"only {len(prompts)} prompt(s) ran; need more than {args.host_from}",
        }
    else:
        start, end = prompts[args.host_from - 1]["rss"], prompts[-1]["rss"]
        growth = (end - start) / start * 100
        host |= {
            "passed": growth <= args.host_limit,
            "detail": f"{start / MIB:.1f} MiB after prompt {args.host_from}, {end / MIB:.1f} MiB after prompt "
            f"{len(prompts)}: {growth:+.2f} %",
            "growth_percent": round(growth, 3),
        }
    checks.append(host)

    kept = result.get("kept_models")
    checks.append(
        {
            "name": "no kept model left" if not args.keep_loaded else "kept models (keep_loaded on)",
            "passed": (kept == 0) if not args.keep_loaded else None if kept is not None else False,
            "detail": f"Free VRAM dropped {kept} kept model(s)" if kept is not None else "Free VRAM failed",
        }
    )
    return checks


def markdown(result: dict) -> str:
    s, server, checks = result["settings"], result["server"], result["criteria"]
    lines = [
        f"{s['count']} prompts of the basic workflow, model {s['model']}, {s['size']}², {s['steps']} steps, "
        f"keep_loaded {'on' if s['keep_loaded'] else 'off'}; ComfyUI {server.get('comfyui')}, torch "
        f"{server.get('pytorch')}, device {server.get('device')}; {result.get('seconds', 0):g} s.",
        "",
        "| criterion | result | figures |",
        "| --- | --- | --- |",
    ]
    for check in checks:
        verdict = {True: "pass", False: "**FAIL**", None: "n/a"}[check["passed"]]
        lines.append(f"| {check['name']} | {verdict} | {check['detail']} |")
    lines += ["", "| prompt | seconds | images | host RSS (MiB) | allocated after (MiB) | error |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for p in result["prompts"]:
        allocated = "-" if p["allocated"] is None else f"{p['allocated'] / MIB:.1f}"
        error = p.get("error", "").replace("|", "/").replace("\n", " ")[:200]
        lines.append(
            f"| {p['index']} | {p['seconds']:.1f} | {p.get('images', 0)} | {p['rss'] / MIB:.1f} | {allocated} "
            f"| {error} |"
        )
    if result["errors"]:
        lines += ["", "Errors:", "", *(f"- {e}" for e in result["errors"])]
    return "\n".join(lines) + "\n"


# ---- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(__doc__, "soak", comfyui=True)
    p.add_argument("--size", type=int, default=512, help="image width and height in px (%(default)s)")
    p.add_argument("--steps", type=int, default=20, help="sampling steps (%(default)s)")
    where = p.add_argument_group("the server")
    where.add_argument("--server", help="attach to this running ComfyUI (http://127.0.0.1:PORT or localhost)")
    where.add_argument("--pid", type=int, help="with --server: its process id (default: found by its port)")
    where.add_argument(
        "--python",
        default=os.environ.get("COMFYUI_PYTHON") or sys.executable,
        help="the interpreter that runs ComfyUI (default: $COMFYUI_PYTHON, else this one)",
    )
    where.add_argument("--cpu", action="store_true", help="start ComfyUI with --cpu")
    where.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the started ComfyUI, e.g. --server-arg=--front-end-root=DIR (repeatable)",
    )
    where.add_argument(
        "--work", type=Path, help="the folder for images/ and server/ (default: a new temporary one)"
    )
    where.add_argument("--base", type=Path, help="the started server's base directory (default: WORK/server)")
    where.add_argument(
        "--random-preset",
        choices=("tiny", "full"),
        help="build a random-weight model of this preset in --model-dir first when it has none",
    )
    run = p.add_argument_group("the prompts")
    run.add_argument(
        "--workflow", type=Path, default=WORKFLOW, help="an API workflow (default: the basic one)"
    )
    run.add_argument("--model", help="the model name on the server (default: --model-dir's folder name)")
    run.add_argument("--count", type=int, default=50)
    run.add_argument("--keep-loaded", action="store_true", help="keep_loaded on in every node")
    run.add_argument("--no-snapshot", action="store_true", help="leave the Memory Snapshot node out")
    run.add_argument(
        "--same-text", action="store_true", help="one T5 text for all (ComfyUI caches the encoder)"
    )
    run.add_argument("--set", dest="sets", action="append", default=[], metavar="NODE.INPUT=VALUE")
    run.add_argument("--max-seconds", type=float, default=3600.0, help="for all prompts together")
    run.add_argument("--prompt-timeout", type=float, default=600.0, help="for each prompt")
    crit = p.add_argument_group("the criteria")
    crit.add_argument("--gpu-limit-mib", type=float, default=64.0)
    crit.add_argument(
        "--host-from", type=int, default=10, help="the prompt host-memory growth is measured from"
    )
    crit.add_argument("--host-limit", type=float, default=5.0, help="per cent")
    crit.add_argument(
        "--judge",
        type=Path,
        metavar="SOAK_JSON",
        help="judge the figures a soak recorded again with these criteria (no server): print them as JSON",
    )
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.count < 1 or args.host_from < 1:
        p.error("--count and --host-from must be 1 or more")
    if args.judge:
        return
    if args.size % 16:
        p.error(f"--size {args.size}: must be a multiple of 16")
    if args.server:
        if args.model_dir is None and args.model is None:
            p.error("--server needs --model (the model's name on that server)")
        return
    if args.comfyui is None:
        p.error("give --comfyui (a ComfyUI checkout; or set COMFYUI_PATH) or --server")
    if args.model_dir is None:
        p.error("give --model-dir (a diffusers PixArt-Σ folder, linked into the server's models/diffusers)")
    if args.random_preset is None and not (args.model_dir / "model_index.json").is_file():
        p.error(f"--model-dir {args.model_dir}: no model_index.json there (build one with --random-preset)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = harness.parse(parser, argv, title=TITLE, render=markdown)
    check_args(parser, args)
    if args.judge:
        checks = judge(json.loads(args.judge.read_text(encoding="utf-8")), args)
        print(json.dumps(checks, indent=1))
        return 0 if all(check["passed"] is not False for check in checks) else 1
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="soak-"))).resolve()
    try:
        if args.server:
            url = comfy_server.loopback_url(args.server)
            pid = args.pid or comfy_server.listening_pid(urlsplit(url).port)
            if pid is None:
                raise ServerError(f"no process of this user listens on {url}; give its --pid")
            result = soak(args, url, pid, args.model or args.model_dir.name)
        else:
            if args.random_preset:
                from pixart_lowvram.cli.random_model import ensure_random_pixart

                ensure_random_pixart(args.model_dir, args.random_preset)
            model = args.model or args.model_dir.name
            base = args.base or args.work / "server"
            with comfy_server.started(
                args.comfyui,
                base.resolve(),
                {model: args.model_dir},
                args.python,
                cpu=args.cpu,
                extra_args=tuple(args.server_args),
            ) as server:
                logger.info("ComfyUI at %s (pid %d), log %s", server.url, server.pid, server.log)
                result = soak(args, server.url, server.pid, model)
    except (ServerError, api.ClientError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    result["criteria"] = judge(result, args)
    run = harness.run(parser, args, None if args.server else args.comfyui)
    result = harness.write(args, result, run=run, title=TITLE, render=markdown)
    print(harness.markdown_text(TITLE, result, markdown))
    return 0 if all(check["passed"] is not False for check in result["criteria"]) else 1


if __name__ == "__main__":
    sys.exit(main())
