"""The pack under ComfyUI-Distributed (the ``comfyui`` tier): a master and workers, each a ComfyUI server on
its own loopback port (CPU, the tiny model in its own models/ folder, the pack and the engine in its
custom_nodes/), the worker set in the master's engine config through the engine's own API
(``POST /distributed/config/update_worker``), and the pack's workflows with a DistributedCollector before
SaveImage and a DistributedSeed into the sampler's seed queued through ``POST /distributed/queue``.

The engine is used in place from ../shared/engines/ComfyUI-Distributed beside the repository (unmodified,
read-only): each server's custom_nodes/ComfyUI-Distributed is a folder of links to its entries
(comfy_server.link_custom_node), because the engine keeps its config, gpu_config.json, beside its code.
Without the snapshot the module is skipped. Every server is stopped by its PID (its process group) when
its fixture ends; every wait is bounded in count and time; all traffic is to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
from comfyui_support import (
    API_WORKFLOW,
    HTTP_TIMEOUT,
    KSAMPLER_API_WORKFLOW,
    MODEL,
    PROMPT_TIMEOUT,
    REPO,
    STEPS,
    ComfyServer,
    basic_prompt,
    free_vram_prompt,
    node_id,
    running_server,
)
from PIL import Image
from tiny_workflows import DISTRIBUTED, DISTRIBUTED_LINK, KSAMPLER_SIZE

from pixart_lowvram.cli.random_model import save_random_lora

pytestmark = [
    pytest.mark.comfyui,  # skipped without COMFYUI_PATH (conftest.py)
    pytest.mark.skipif(
        not (DISTRIBUTED / "__init__.py").is_file(),
        reason=f"ComfyUI-Distributed is not at {DISTRIBUTED} (../shared/engines/ComfyUI-Distributed beside "
        "the repository): the tests of the pack under it need that snapshot",
    ),
]

EXAMPLE = REPO / "workflows" / "api" / "pixart_lowvram_distributed_api.json"
WORKER = "w1"  # the worker's id in the master's engine config
LORA = "tiny-lora.safetensors"
# The master's collector gives up on a worker that sent nothing for this long and is not busy (the
# engine's settings.worker_timeout_seconds; its default is 60 s).
WORKER_TIMEOUT = 10
POLL = 0.2  # seconds between looks at a server's /history or /queue
STAGES = ("t5_encode", "sample", "vae_decode")


# ---- servers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def participant(request, base: Path, tiny_folder: Path, pack: bool = True):
    """A server with the engine in custom_nodes (and the pack unless ``pack`` is False) and a random LoRA
    of the tiny model in its own models/loras."""
    save_random_lora(tiny_folder, base / "models" / "loras" / LORA, scale=0.15)
    with running_server(
        request, base, tiny_folder, custom_nodes={DISTRIBUTED_LINK: DISTRIBUTED}, pack=pack
    ) as server:
        yield server


def port(server: ComfyServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def add_worker(master: ComfyServer, worker_id: str, worker: ComfyServer) -> None:
    """The worker in the master's engine config, as its Distributed panel adds a worker started by hand
    ("remote": its host and port are given; the master does not launch it)."""
    body = {
        "worker_id": worker_id,
        "name": worker_id,
        "host": "127.0.0.1",
        "port": port(worker),
        "cuda_device": None,
        "enabled": True,
        "type": "remote",
    }
    response = requests.post(
        master.url + "/distributed/config/update_worker", json=body, timeout=HTTP_TIMEOUT
    )
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A home and a temporary folder of the servers' own, empty: nothing may land there."""
    return {name: tmp_path_factory.mktemp(f"servers_{name}") for name in ("home", "tmp")}


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory, tiny_folder, folders) -> dict[str, ComfyServer]:
    """The master and one worker. They start with HOME and TMPDIR in empty folders of their own and none
    of the pack's folder variables (PIXART_LOWVRAM_HOME, PIXART_LOWVRAM_QUANT_CACHE) set, so whatever the
    pack writes goes where it does in a user's ComfyUI."""
    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(folders["home"]))
        patch.setenv("TMPDIR", str(folders["tmp"]))
        for name in ("XDG_CACHE_HOME", "PIXART_LOWVRAM_HOME", "PIXART_LOWVRAM_QUANT_CACHE"):
            patch.delenv(name, raising=False)
        servers = {
            name: stack.enter_context(participant(request, tmp_path_factory.mktemp(name), tiny_folder))
            for name in ("master", WORKER)
        }
        patch.undo()
        master = servers["master"]
        add_worker(master, WORKER, servers[WORKER])
        response = requests.post(
            master.url + "/distributed/config/update_setting",
            json={"key": "worker_timeout_seconds", "value": WORKER_TIMEOUT},
            timeout=HTTP_TIMEOUT,
        )
        assert response.status_code == 200, response.text
        yield servers


# ---- prompts ------------------------------------------------------------------------------------


def distributed(prompt: dict, seed: int | None = None) -> dict:
    """``prompt`` with a DistributedCollector before its SaveImage and, when ``seed`` is given, a
    DistributedSeed of it into the sampler's seed (the engine gives the master ``seed`` and the n-th
    worker ``seed + n + 1``); the new nodes take the next free numeric ids, seed first."""
    prompt = json.loads(json.dumps(prompt))
    ids = (str(n) for n in itertools.count(max(map(int, prompt)) + 1))
    save = node_id(prompt, "SaveImage")
    if seed is not None:
        seed_id = next(ids)
        (sampler,) = [key for key, node in prompt.items() if "seed" in node["inputs"]]
        prompt[seed_id] = {
            "class_type": "DistributedSeed",
            "_meta": {"title": "Distributed Seed"},
            "inputs": {"seed": seed},
        }
        prompt[sampler]["inputs"]["seed"] = [seed_id, 0]
    collector = next(ids)
    prompt[collector] = {
        "class_type": "DistributedCollector",
        "_meta": {"title": "Distributed Collector"},
        "inputs": {"images": prompt[save]["inputs"]["images"], "load_balance": False},
    }
    prompt[save]["inputs"]["images"] = [collector, 0]
    return prompt


def test_the_distributed_example_is_the_basic_workflow_with_the_engines_nodes():
    """workflows/api/pixart_lowvram_distributed_api.json (docs/USAGE.md, Many GPUs / machines) is the bundled
    basic API workflow with this module's two nodes."""
    basic = json.loads(API_WORKFLOW.read_text(encoding="utf-8"))
    assert json.loads(EXAMPLE.read_text(encoding="utf-8")) == distributed(basic, seed=0)


def fresh_basic(seed: int = 0) -> dict:
    """The basic workflow with a text of its own, so that T5 runs rather than coming from the cache."""
    prompt = basic_prompt(seed=seed)
    prompt[node_id(prompt, "PixArtQ_T5Encode")]["inputs"]["prompt"] += f", {uuid.uuid4().hex[:8]}"
    return prompt


def fresh_ksampler(seed: int = 0) -> dict:
    """The int8 MODEL + core KSampler workflow on the tiny model, with the servers' LoRA and its own text."""
    prompt = json.loads(KSAMPLER_API_WORKFLOW.read_text(encoding="utf-8"))
    for node in prompt.values():
        if isinstance(node["inputs"].get("model"), str):
            node["inputs"]["model"] = MODEL
    prompt[node_id(prompt, "PixArtQ_T5Encode")]["inputs"]["prompt"] += f", {uuid.uuid4().hex[:8]}"
    prompt[node_id(prompt, "LoraLoaderModelOnly")]["inputs"]["lora_name"] = LORA
    prompt[node_id(prompt, "EmptyLatentImage")]["inputs"].update(width=KSAMPLER_SIZE, height=KSAMPLER_SIZE)
    prompt[node_id(prompt, "KSampler")]["inputs"].update(steps=STEPS, seed=seed)
    return prompt


def queue(master: ComfyServer, prompt: dict, workers: list[str]) -> requests.Response:
    body = {"prompt": prompt, "client_id": uuid.uuid4().hex, "enabled_worker_ids": workers}
    return requests.post(master.url + "/distributed/queue", json=body, timeout=PROMPT_TIMEOUT)


def until(condition, timeout: float, what: str):
    """``condition()``'s first true value, asked every POLL seconds; the test fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / POLL) + 1):
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(POLL)
    pytest.fail(f"{what} within {timeout} s")


def done(entry: dict | None) -> dict | None:
    """A /history entry once its prompt has finished (done, or failed)."""
    if entry is None or entry["status"].get("status_str") not in ("success", "error"):
        return None
    return entry


def finished(server: ComfyServer, prompt_id: str, timeout: float = PROMPT_TIMEOUT) -> dict:
    """The prompt's /history entry once it has finished."""
    return until(
        lambda: done(server.get(f"/history/{prompt_id}").get(prompt_id)),
        timeout,
        f"prompt {prompt_id} on {server.url} did not finish",
    )


def run_distributed(master: ComfyServer, prompt: dict, workers: list[str]) -> dict:
    response = queue(master, prompt, workers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["worker_count"] == len(workers), body
    return finished(master, body["prompt_id"])


def job_id(entry: dict) -> str:
    """The collector's job id, as the engine set it in the master's prompt."""
    (collector,) = [
        node for node in entry["prompt"][2].values() if node["class_type"] == "DistributedCollector"
    ]
    return collector["inputs"]["multi_job_id"]


def worker_entry(worker: ComfyServer, job: str) -> dict:
    """The worker's /history entry of the prompt the engine sent it for the master's job ``job``, once
    finished."""

    def find() -> dict | None:
        for entry in worker.get("/history").values():
            nodes = entry["prompt"][2].values()
            jobs = [
                n["inputs"].get("multi_job_id") for n in nodes if n["class_type"] == "DistributedCollector"
            ]
            if jobs == [job]:
                return done(entry)
        return None

    return until(find, PROMPT_TIMEOUT, f"no finished prompt for job {job} on {worker.url}")


def saved(server: ComfyServer, entry: dict) -> list[np.ndarray]:
    """The images of the entry's SaveImage, each checked to be a whole PNG."""
    assert entry["status"]["status_str"] == "success", entry["status"]
    (node,) = [key for key, node in entry["prompt"][2].items() if node["class_type"] == "SaveImage"]
    images = []
    for image in entry["outputs"][node]["images"]:
        images.append(png_pixels(server.output / image["subfolder"] / image["filename"]))
    return images


def png_pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()  # the whole file: a truncated PNG fails here
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def solo(server: ComfyServer, prompt: dict) -> np.ndarray:
    """The prompt's one image through plain POST /prompt on ``server``."""
    run = server.run(prompt)
    assert run.status == "success", run.error
    (image,) = saved(server, run.history)
    return image


def snapshot_text(entry: dict) -> str:
    (node,) = [
        key for key, node in entry["prompt"][2].items() if node["class_type"] == "PixArtQ_MemorySnapshot"
    ]
    return "\n".join(entry["outputs"][node]["text"])


def stage_rows(text: str) -> list[str]:
    """The stages of a Memory Snapshot's table, in order."""
    return re.findall(r"^\| (\w+) \| cpu \|", text, flags=re.MULTILINE)


def host_memory_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith("host memory: ")]
    return line


def kept_models(server: ComfyServer) -> str:
    """What Free VRAM says it dropped, through plain POST /prompt."""
    prompt = free_vram_prompt()
    run = server.run(prompt)
    assert run.status == "success", run.error
    return run.text("free")


# ---- the workflows ------------------------------------------------------------------------------


def test_basic_workflow_on_master_and_worker(cluster):
    """The basic workflow with a collector and a DistributedSeed, queued on the master for it and the
    worker: the master's history holds one PNG per participant, the master's first; both ran the pack's
    three stages, each with the model from its own models/ folder; the engine's seeds (the master's, the
    worker's one more) give the images the pack gives for those seeds alone; each participant's models
    are where the pack leaves them alone (none kept loaded, the same in host memory)."""
    master, worker = cluster["master"], cluster[WORKER]
    seed = 40
    prompt = fresh_basic()
    starts = {name: server.log.stat().st_size for name, server in cluster.items()}
    entry = run_distributed(master, distributed(prompt, seed), [WORKER])
    images = saved(master, entry)
    assert len(images) == 2, "one image per participant"
    assert not np.array_equal(images[0], images[1]), "the engine's seeds differ"
    work = worker_entry(worker, job_id(entry))
    assert work["status"]["status_str"] == "success", work["status"]

    # The engine's rewrites, as the worker got them: its seed node and collector.
    rewritten = work["prompt"][2]
    assert rewritten[node_id(rewritten, "DistributedSeed")]["inputs"] == {
        "seed": seed,
        "is_worker": True,
        "worker_id": "worker_0",
    }
    collector = rewritten[node_id(rewritten, "DistributedCollector")]["inputs"]
    assert collector["is_worker"] is True and collector["worker_id"] == WORKER
    assert collector["master_url"] == master.url
    assert node_id(rewritten, "PixArtQ_Sampler")  # the pack's nodes went as they were
    assert "SaveImage" not in {node["class_type"] for node in rewritten.values()}  # the engine prunes it

    for name, server, history in (("master", master, entry), (WORKER, worker, work)):
        text = snapshot_text(history)
        assert stage_rows(text) == list(STAGES), (name, text)
        log = server.log_text(starts[name])
        for stage in ("text_encoder", "transformer", "vae"):
            own = f"('{stage}', '{server.models / MODEL}'"
            assert own in log, f"{name} did not load its {stage} from its own folder"
        records = sorted(server.output.glob("pixart_memory_*.json"))
        assert [r["stage"] for r in json.loads(records[-1].read_text())["stages"]] == list(STAGES)

    # The same prompts through plain POST /prompt, one server at a time: the same bits.
    alone = dict(prompt)
    assert np.array_equal(solo(master, basic_at(alone, seed)), images[0])
    assert np.array_equal(solo(worker, basic_at(alone, seed + 1)), images[1])
    # Freed as alone: no model kept loaded anywhere, host memory as the pack leaves it after a prompt.
    lone = master.run(basic_at(fresh_basic(), seed))
    assert lone.status == "success", lone.error
    lone_line = host_memory_line(lone.text(node_id(prompt, "PixArtQ_MemorySnapshot")))
    assert host_memory_line(snapshot_text(entry)) == lone_line
    assert host_memory_line(snapshot_text(work)) == lone_line
    for server in (master, worker):
        assert kept_models(server).startswith("dropped 0 kept model(s)")


def basic_at(prompt: dict, seed: int) -> dict:
    prompt = json.loads(json.dumps(prompt))
    prompt[node_id(prompt, "PixArtQ_Sampler")]["inputs"]["seed"] = seed
    return prompt


def test_ksampler_workflow_on_master_and_worker(cluster):
    """The int8 MODEL + LoRA + core KSampler workflow with a collector and a DistributedSeed: one PNG per
    participant, the seeds the engine set (the worker's image is the worker's own for seed + 1), the
    pack's stages on each (T5, the MODEL, the VAE) from its own folders, and no pack model kept loaded."""
    master, worker = cluster["master"], cluster[WORKER]
    seed = 7
    prompt = fresh_ksampler()
    starts = {name: server.log.stat().st_size for name, server in cluster.items()}
    entry = run_distributed(master, distributed(prompt, seed), [WORKER])
    images = saved(master, entry)
    assert len(images) == 2 and images[0].shape == (KSAMPLER_SIZE, KSAMPLER_SIZE, 3)
    assert not np.array_equal(images[0], images[1])
    work = worker_entry(worker, job_id(entry))
    assert work["status"]["status_str"] == "success", work["status"]
    rewritten = work["prompt"][2]
    assert rewritten[node_id(rewritten, "DistributedSeed")]["inputs"]["worker_id"] == "worker_0"
    for name, server in cluster.items():
        log = server.log_text(starts[name])
        assert "Traceback" not in log, (name, log[-4000:])
        assert "stage t5_encode" in log and "stage vae_decode" in log, name
        assert re.search(r"PixArt-Σ .* MODEL: .* layers quantized", log), name
        assert f"('text_encoder', '{server.models / MODEL}'" in log, name
        assert "lora key not loaded" not in log
    ksampler = node_id(prompt, "KSampler")
    for server, index, value in ((master, 0, seed), (worker, 1, seed + 1)):
        alone = json.loads(json.dumps(prompt))
        alone[ksampler]["inputs"]["seed"] = value
        assert np.array_equal(solo(server, alone), images[index])
    for server in (master, worker):
        assert kept_models(server).startswith("dropped 0 kept model(s)")


# ---- the pack as a worker -----------------------------------------------------------------------


def test_same_prompt_gives_the_same_bits_on_master_and_worker(cluster):
    """Without a DistributedSeed both participants run the same prompt: the same bits, whatever ran on
    each server before."""
    entry = run_distributed(cluster["master"], distributed(fresh_basic(seed=3)), [WORKER])
    first, second = saved(cluster["master"], entry)
    assert first.std() > 10, "a flat image would prove nothing"
    assert np.array_equal(first, second)


def test_nothing_is_written_outside_comfyuis_folders(cluster, folders):
    """After the prompts above (run this module whole): the servers' home and temporary folders are
    empty, and the pack's pre-quantized weights are in each server's own models/ folder, made from its own
    copy of the model. The engine's config is in each server's custom_nodes/, not in the snapshot."""
    run_distributed(cluster["master"], distributed(fresh_basic(seed=5)), [WORKER])
    for name, folder in folders.items():
        left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
        assert left == [], f"written in the servers' {name}: {left[:20]}"
    for name, server in cluster.items():
        cache = server.base / "models" / "pixart_lowvram" / "quantized"
        sources = [json.loads(p.read_text())["source"] for p in cache.glob("*/source.json")]
        assert sources, f"{name}: no pre-quantized weights under {cache}"
        assert all(Path(source).is_relative_to(server.models / MODEL) for source in sources), sources
        assert (server.base / "custom_nodes" / DISTRIBUTED_LINK / "gpu_config.json").is_file()
    assert not (DISTRIBUTED / "gpu_config.json").exists()


# ---- faults -------------------------------------------------------------------------------------


def memory_log(server: ComfyServer) -> str:
    """The last lines of ComfyUI's in-memory log, as the engine serves it."""
    return server.get("/distributed/local_log?lines=3000")["content"]


def whole_files(folder: Path) -> list[Path]:
    """Every file under an output folder, each checked whole: PNGs decode to the end, JSON parses, no
    temporary or partial file is left."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        assert not re.search(r"\.(partial|tmp)$|^tmp", path.name), path
        if path.suffix == ".png":
            png_pixels(path)
        elif path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert path.stat().st_size > 0, path
    return files


def test_a_worker_killed_mid_prompt(request, cluster, tmp_path_factory, tiny_folder):
    """A second worker killed by its PID while it runs the prompt: the master finishes within the
    engine's worker timeout with the images it has (its own and the living worker's), says which worker
    it gave up on, serves the next prompt, and no output folder holds a half-written file."""
    master = cluster["master"]
    with participant(request, tmp_path_factory.mktemp("doomed"), tiny_folder) as doomed:
        add_worker(master, "doomed", doomed)
        start = master.log.stat().st_size
        tracebacks = memory_log(master).count("Traceback")
        response = queue(master, distributed(fresh_basic(), seed=60), [WORKER, "doomed"])
        assert response.status_code == 200, response.text
        assert response.json()["worker_count"] == 2
        # Mid-prompt: T5 has run, the sampler or the decoder is running.
        until(
            lambda: doomed.get("/queue")["queue_running"] and "stage t5_encode" in doomed.log_text(),
            PROMPT_TIMEOUT,
            "the doomed worker did not get through T5",
        )
        killed = time.monotonic()
        os.killpg(doomed.pid, signal.SIGKILL)
        entry = finished(master, response.json()["prompt_id"], timeout=WORKER_TIMEOUT + 120)
        took = time.monotonic() - killed
        assert took < WORKER_TIMEOUT + 120
        images = saved(master, entry)
        assert len(images) == 2, "the master's image and the living worker's"
        # The engine prints it: ComfyUI's log file gets prints late (its stdout wrapper is not line
        # buffered), its in-memory log at once; the engine serves that.
        log = memory_log(master)
        assert "Still waiting for workers: ['doomed']" in log, log[-4000:]
        assert "Traceback" not in master.log_text(start) and log.count("Traceback") == tracebacks
        for folder in (doomed.output, cluster[WORKER].output):
            whole_files(folder)
    requests.post(
        master.url + "/distributed/config/delete_worker", json={"worker_id": "doomed"}, timeout=HTTP_TIMEOUT
    )
    assert len(saved(master, run_distributed(master, distributed(fresh_basic()), [WORKER]))) == 2
    whole_files(master.output)


def test_a_worker_without_the_pack(request, cluster, tmp_path_factory, tiny_folder):
    """A worker with the engine but not the pack: /distributed/queue refuses the prompt with one line
    naming the node the worker lacks (ComfyUI's validation, passed on by the engine), the master's log
    has no traceback, no prompt runs anywhere, and the master serves the next prompt."""
    master = cluster["master"]
    with participant(request, tmp_path_factory.mktemp("bare"), tiny_folder, pack=False) as bare:
        add_worker(master, "bare", bare)
        start = master.log.stat().st_size
        before = len(master.get("/history"))
        response = queue(master, distributed(fresh_basic(), seed=1), ["bare"])
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert "\n" not in error
        # ComfyUI's validation names the first node it lacks (which one is first depends on the order of
        # the engine's pruned prompt), in its version's words: "Node 'Quantized T5 Encode' not found. The
        # custom node may not be installed." (0.33), "Cannot execute because node PixArtQ_MemorySnapshot
        # does not exist." (0.8).
        assert re.search(r"not found\. The custom node may not be installed|does not exist", error), error
        assert re.search(r"\bPixArtQ_\w+", error), error
        assert "Traceback" not in master.log_text(start)
        assert len(master.get("/history")) == before, "the master queued nothing"
        assert bare.get("/history") == {}
    requests.post(
        master.url + "/distributed/config/delete_worker", json={"worker_id": "bare"}, timeout=HTTP_TIMEOUT
    )
    assert len(saved(master, run_distributed(master, distributed(fresh_basic()), [WORKER]))) == 2
