"""Images per minute through ComfyUI-Distributed: a master and ``--servers`` - 1 workers, each a ComfyUI on
127.0.0.1 and its own free port with the pack and the engine in its custom_nodes/ and the model in its
models/diffusers/, the workers set in the master's engine config through the engine's API, and the docs'
example workflow (workflows/api/pixart_lowvram_distributed_api.json: the basic workflow with a DistributedSeed and a
DistributedCollector) queued ``--prompts`` times through ``POST /distributed/queue``, one after another.
Each prompt gives one image per server; the figure is images saved by the master over the wall time from
the first queue to the last prompt's end (each prompt's T5 text differs, so every stage runs every time).

The engine is used in place (``--engine``, default ../shared/engines/ComfyUI-Distributed beside the
repository): each server's custom_nodes/ComfyUI-Distributed links to its entries. Tiny model on the CPU:

    python benchmarks/distributed.py --comfyui /path/to/ComfyUI --servers 1 --name distributed_1
    python benchmarks/distributed.py --comfyui /path/to/ComfyUI --servers 2

Prints one line and writes ``distributed.json`` and ``distributed.md`` (``--name``) to ``--out``; the tiny
model and the servers' base directories go to ``--work`` (default: a new temporary folder).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import harness  # first: the tests' server support (comfy_server) is importable once it is

# isort: split
import comfy_server
import requests

REPO = harness.REPO
EXAMPLE = REPO / "workflows" / "api" / "pixart_lowvram_distributed_api.json"
ENGINE = REPO.parent / "shared" / "engines" / "ComfyUI-Distributed"
MODEL = "tiny-pixart"
HTTP_TIMEOUT = 60
TITLE = "Images per minute through ComfyUI-Distributed"


def prompt_for(n: int, size: int, steps: int) -> dict:
    prompt = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    for node in prompt.values():
        inputs = node["inputs"]
        if isinstance(inputs.get("model"), str):
            inputs["model"] = MODEL
        if node["class_type"] == "PixArtQ_Sampler":
            inputs.update(width=size, height=size, steps=steps)
        if node["class_type"] == "PixArtQ_T5Encode":
            inputs["prompt"] += f", {n}"
        if node["class_type"] == "DistributedSeed":
            inputs["seed"] = 1000 * n
    return prompt


def wait(url: str, prompt_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.2) + 1):
        entry = requests.get(f"{url}/history/{prompt_id}", timeout=HTTP_TIMEOUT).json().get(prompt_id)
        if entry and entry["status"].get("status_str") in ("success", "error"):
            return entry
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    raise comfy_server.ServerError(f"prompt {prompt_id} did not finish within {timeout:g} s")


def markdown(result: dict) -> str:
    lines = harness.table(
        ["servers", "prompts", "images", "seconds", "images a minute", "size", "steps", "CPUs"],
        [
            [
                result["servers"],
                result["prompts"],
                result["images"],
                result["seconds"],
                result["images_per_minute"],
                f"{result['size']}²",
                result["steps"],
                result["cpus"],
            ]
        ],
    )
    return "The tiny model on the CPU, one image per server and prompt.\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, "distributed", model_dir=False, comfyui=True, size=64, steps=3)
    parser.add_argument("--python", default=sys.executable, help="ComfyUI's interpreter (this one)")
    parser.add_argument("--engine", type=Path, default=ENGINE, help="ComfyUI-Distributed's folder")
    parser.add_argument("--servers", type=int, default=2, help="the master and the workers (2)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts queued, one after another (8)")
    parser.add_argument("--prompt-timeout", type=float, default=600.0)
    parser.add_argument(
        "--work", type=Path, help="the folder for the model and the servers (default: a new temporary one)"
    )
    args = harness.parse(parser, argv, title=TITLE, render=markdown, required=("comfyui",))
    if args.servers < 1 or args.prompts < 1:
        parser.error("--servers and --prompts are at least 1")

    from pixart_lowvram.cli.random_model import build_random_pixart

    work = (args.work or Path(tempfile.mkdtemp(prefix="distributed-"))).resolve()
    model = work / "model"
    if not model.is_dir():
        build_random_pixart(model, "tiny")
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                comfy_server.started(
                    Path(args.comfyui),
                    work / f"server{n}",
                    models={MODEL: model},
                    python=args.python,
                    cpu=True,
                    custom_nodes={"ComfyUI-Distributed": args.engine},
                )
            )
            for n in range(args.servers)
        ]
        master, workers = servers[0], servers[1:]
        ids = [f"worker{n}" for n in range(1, args.servers)]
        for worker_id, worker in zip(ids, workers, strict=True):
            body = {
                "worker_id": worker_id,
                "name": worker_id,
                "host": "127.0.0.1",
                "port": int(worker.url.rsplit(":", 1)[1]),
                "cuda_device": None,
                "enabled": True,
                "type": "remote",
            }
            response = requests.post(
                master.url + "/distributed/config/update_worker", json=body, timeout=HTTP_TIMEOUT
            )
            response.raise_for_status()
        # One prompt first, not counted: every server loads its libraries and builds its quantized cache.
        times, images = [], 0
        for n in range(args.prompts + 1):
            started = time.monotonic()
            body = {"prompt": prompt_for(n, args.size, args.steps), "client_id": uuid.uuid4().hex}
            response = requests.post(
                master.url + "/distributed/queue",
                json={**body, "enabled_worker_ids": ids},
                timeout=HTTP_TIMEOUT,
            )
            response.raise_for_status()
            entry = wait(master.url, response.json()["prompt_id"], args.prompt_timeout)
            if entry["status"]["status_str"] != "success":
                raise comfy_server.ServerError(f"prompt {n} failed: {entry['status']}")
            saved = [o for o in entry["outputs"].values() if "images" in o]
            count = sum(len(o["images"]) for o in saved)
            if count != args.servers:
                raise comfy_server.ServerError(f"prompt {n}: {count} images, not one per server")
            if n:
                times.append(time.monotonic() - started)
                images += count
    total = sum(times)
    result = {
        "servers": args.servers,
        "prompts": args.prompts,
        "images": images,
        "seconds": round(total, 2),
        "images_per_minute": round(60 * images / total, 1),
        "size": args.size,
        "steps": args.steps,
        "cpus": os.cpu_count(),
    }
    harness.write(args, result, run=harness.run(parser, args, args.comfyui), title=TITLE, render=markdown)
    print(
        f"{args.servers} server(s): {images} images in {total:.1f} s = {result['images_per_minute']} images/min "
        f"({args.size}px, {args.steps} steps, {os.cpu_count()} CPUs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
