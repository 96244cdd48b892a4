"""Images per minute through ComfyUI-Distributed: a master and ``--servers`` - 1 workers, each a ComfyUI on
127.0.0.1 and its own free port with the pack and the engine in its custom_nodes/ and the model in its
models/diffusers/, the workers set in the master's engine config through the engine's API, and the
example workflow (workflows/api/pixart_lowvram_distributed_api.json: the basic workflow with a
DistributedSeed and a DistributedCollector) queued ``--prompts`` times through ``POST /distributed/queue``,
one after another.
Each prompt gives one image per server; the figure is images saved by the master over the wall time from
the first queue to the last prompt's end (each prompt's T5 text differs, so every stage runs every time).

The engine is used in place (``--engine``, default ../shared/engines/ComfyUI-Distributed beside the
repository): each server's custom_nodes/ComfyUI-Distributed links to its entries. Tiny model on the CPU:

    python benchmarks/distributed.py --comfyui /path/to/ComfyUI --servers 1 --out dist-1
    python benchmarks/distributed.py --comfyui /path/to/ComfyUI --servers 2 --out dist-2

Prints one line and writes ``distributed.json`` to ``--out`` (the servers' base directories are there too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import comfy_server
import requests

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "workflows" / "api" / "pixart_lowvram_distributed_api.json"
ENGINE = REPO.parent / "shared" / "engines" / "ComfyUI-Distributed"
MODEL = "tiny-pixart"
HTTP_TIMEOUT = 60


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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), help="a ComfyUI checkout")
    parser.add_argument("--python", default=sys.executable, help="ComfyUI's interpreter (this one)")
    parser.add_argument("--engine", type=Path, default=ENGINE, help="ComfyUI-Distributed's folder")
    parser.add_argument("--servers", type=int, default=2, help="the master and the workers (2)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts queued, one after another (8)")
    parser.add_argument("--size", type=int, default=64, help="image side in px (64, the tiny model's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompt-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not args.comfyui:
        parser.error("give --comfyui or set COMFYUI_PATH")
    if args.servers < 1 or args.prompts < 1:
        parser.error("--servers and --prompts are at least 1")

    from pixart_lowvram.cli.random_model import build_random_pixart

    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model"
    if not model.is_dir():
        build_random_pixart(model, "tiny")
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                comfy_server.started(
                    Path(args.comfyui),
                    args.out / f"server{n}",
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
    (args.out / "distributed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{args.servers} server(s): {images} images in {total:.1f} s = {result['images_per_minute']} images/min "
        f"({args.size}px, {args.steps} steps, {os.cpu_count()} CPUs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
