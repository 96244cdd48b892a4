"""The API client's pure parts (no server): --set/--prompt/--seed on a workflow, the check against an
/object_info answer, seeds per prompt for --count, the submit that never queues a job twice, and the end of
a prompt read from the websocket's messages."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
import requests

from pixart_lowvram.cli import client
from pixart_lowvram.cli.client import ClientError, apply_overrides, check_workflow, expand

REPO = Path(__file__).resolve().parents[1]
API_WORKFLOW = REPO / "workflows" / "api" / "pixart_lowvram_basic_api.json"
MODEL = "PixArt-Sigma-XL-2-1024-MS"


@pytest.fixture
def workflow() -> dict:
    return client.load_workflow(API_WORKFLOW)


def object_info(models: list[str], legacy_combo: bool = False) -> dict:
    """The parts of /object_info the check reads, as ComfyUI 0.8 writes them for V3 nodes (or for
    legacy nodes, whose combo is the option list itself)."""

    def combo(options: list[str]) -> list:
        return [options, {}] if legacy_combo else ["COMBO", {"options": options, "tooltip": "…"}]

    return {
        "PixArtQ_T5Encode": {
            "input": {
                "required": {
                    "model": combo(models),
                    "prompt": ["STRING", {}],
                    "quantization": combo(["nf4"]),
                },
                "optional": {"t5_file": combo(["(from model)"])},
            }
        },
        "PixArtQ_Sampler": {
            "input": {
                "required": {"model": combo(models), "embeds": ["PIXART_EMBEDS", {}], "seed": ["INT", {}]},
                "optional": {"scheduler": combo(["dpmsolver++", "euler"])},
            }
        },
        "PixArtQ_VAEDecode": {"input": {"required": {"model": combo(models), "tiling": combo(["auto"])}}},
        "PixArtQ_MemorySnapshot": {"input": {"required": {"value": ["*", {}]}}},
        "SaveImage": {"input": {"required": {"images": ["IMAGE", {}]}}},
    }


def test_set_keeps_each_inputs_type(workflow):
    sets = ["2.steps=30", "2.cfg=7", "2.keep_loaded=true", "1.negative_prompt=blurry, dark", "3.tiling=off"]
    changed = apply_overrides(workflow, sets)
    sampler = changed["2"]["inputs"]
    assert sampler["steps"] == 30 and type(sampler["steps"]) is int
    assert sampler["cfg"] == 7.0 and type(sampler["cfg"]) is float
    assert sampler["keep_loaded"] is True
    assert changed["1"]["inputs"]["negative_prompt"] == "blurry, dark"
    assert changed["3"]["inputs"]["tiling"] == "off"
    assert workflow["2"]["inputs"]["steps"] == 20, "the workflow passed in is not changed"
    assert apply_overrides(workflow, ["2.keep_loaded=0"])["2"]["inputs"]["keep_loaded"] is False


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("9.steps=3", "no node '9'; the workflow's nodes: 1, 2, 3, 4, 5"),
        ("2.step=3", "node 2 (PixArtQ_Sampler) input 'step' does not exist; its inputs: model, embeds"),
        ("2.steps=many", "'many' is not an integer (the current value is 20)"),
        ("2.cfg=high", "'high' is not a number"),
        ("2.keep_loaded=maybe", "'maybe' is not true or false"),
        ("2.embeds=x", "is linked to node '1'; --set sets widget values only"),
        ("steps=3", "expected NODE.INPUT=VALUE"),
        ("2.steps", "expected NODE.INPUT=VALUE"),
    ],
)
def test_set_refuses_what_it_cannot_apply(workflow, assignment, message):
    with pytest.raises(ClientError) as caught:
        apply_overrides(workflow, [assignment])
    assert message in str(caught.value)


def test_model_and_size_reach_every_node_that_has_them():
    """--model names the model on every node with a model name, links left alone (the LoRA loader's MODEL);
    --size sets every width and height (the sampler, core's Empty Latent Image), the sampler's resolution
    then custom; nothing else changes."""
    for name, width_nodes in (("basic", ["2"]), ("lora_ksampler", ["4"])):
        workflow = client.load_workflow(API_WORKFLOW.with_name(f"pixart_lowvram_{name}_api.json"))
        changed = apply_overrides(workflow, model="tiny-pixart", size=(768, 1344))
        named = [key for key, node in workflow.items() if isinstance(node["inputs"].get("model"), str)]
        assert len(named) == 3, f"{name}: T5 Encode, the sampler or model loader, VAE Decode"
        assert [changed[key]["inputs"]["model"] for key in named] == ["tiny-pixart"] * 3
        assert [key for key, node in changed.items() if "width" in node["inputs"]] == width_nodes
        for key in width_nodes:
            inputs = changed[key]["inputs"]
            assert (inputs["width"], inputs["height"]) == (768, 1344)
        for key, node in changed.items():
            untouched = {k: v for k, v in node["inputs"].items() if k not in ("model", "width", "height")}
            before = {
                k: v for k, v in workflow[key]["inputs"].items() if k not in ("model", "width", "height")
            }
            assert untouched == before, f"{name} node {key}: only the model and the size change"
        if name == "lora_ksampler":
            assert changed["3"]["inputs"]["model"] == ["2", 0], "a linked model stays linked"


def test_size_sets_a_preset_sampler_to_custom(workflow):
    """A sampler on a resolution preset would ignore width and height: --size makes it take them."""
    from pixart_lowvram.core.resolutions import CUSTOM_RESOLUTION

    assert client.CUSTOM_SIZE == CUSTOM_RESOLUTION
    workflow["2"]["inputs"]["resolution"] = "1024: 1216×832 (1.46:1)"
    assert apply_overrides(workflow, size=(512, 768))["2"]["inputs"]["resolution"] == CUSTOM_RESOLUTION
    assert apply_overrides(workflow)["2"]["inputs"]["resolution"] == "1024: 1216×832 (1.46:1)"


def test_set_comes_after_model_and_size(workflow):
    changed = apply_overrides(
        workflow, ["3.model=other", "2.width=512"], model="tiny-pixart", size=(768, 768)
    )
    assert [changed[key]["inputs"]["model"] for key in ("1", "2", "3")] == [
        "tiny-pixart",
        "tiny-pixart",
        "other",
    ]
    assert (changed["2"]["inputs"]["width"], changed["2"]["inputs"]["height"]) == (512, 768)


@pytest.mark.parametrize(
    ("text", "size"), [("768x1344", (768, 1344)), ("1024X1024", (1024, 1024)), (" 512 × 640 ", (512, 640))]
)
def test_size_reads_width_by_height(text, size):
    assert client.parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1024", "--size '1024': expected WIDTHxHEIGHT in pixels, e.g. 768x1344"),
        ("1024x", "--size '1024x': expected WIDTHxHEIGHT"),
        ("-512x512", "--size '-512x512': expected WIDTHxHEIGHT"),
        ("512.5x512", "--size '512.5x512': expected WIDTHxHEIGHT"),
        ("1024*768", "--size '1024*768': expected WIDTHxHEIGHT"),
        ("0x512", "--size '0x512': width and height must be above 0"),
        ("100x96", "--size '100x96': width 100 is not a multiple of 16; use 96 or 112."),
        ("100x100", "--size '100x100': width 100 is not a multiple of 16; use 96 or 112. height 100 is not"),
        ("512x8192", "--size '512x8192': height 8192 is out of range; use 64..4096 pixels."),
    ],
)
def test_size_refuses_what_is_not_width_by_height(text, message):
    with pytest.raises(ClientError) as refused:
        client.parse_size(text)
    assert str(refused.value).startswith(message)


def test_model_and_size_need_a_node_to_set():
    bare = {
        "3": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["2", 0]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": ["9", 0], "height": 512}},
    }
    with pytest.raises(ClientError, match="--model: the workflow has no node with a model name"):
        apply_overrides(bare, model="x")
    with pytest.raises(ClientError, match="--size: the workflow has no node with width and height inputs"):
        apply_overrides(bare, size=(512, 512))


def test_prompt_and_seed_reach_every_matching_input(workflow):
    workflow["6"] = {"class_type": "PixArtQ_T5Encode", "inputs": {"prompt": "other", "model": MODEL}}
    workflow["7"] = {"class_type": "KSampler", "inputs": {"seed": 3}}
    changed = apply_overrides(workflow, ["2.seed=5"], prompt="a blue dog", seed=42)
    assert [changed[key]["inputs"]["prompt"] for key in ("1", "6")] == ["a blue dog"] * 2
    assert [changed[key]["inputs"]["seed"] for key in ("2", "7")] == [42, 42]


def test_prompt_and_seed_need_a_node_to_set():
    bare = {"5": {"class_type": "SaveImage", "inputs": {"images": ["4", 0]}}}
    with pytest.raises(ClientError, match="--prompt: the workflow has no PixArtQ_T5Encode node"):
        apply_overrides(bare, prompt="x")
    with pytest.raises(ClientError, match="--seed: the workflow has no node with a seed input"):
        apply_overrides(bare, seed=1)


def test_count_increments_every_seed(workflow):
    workflow["7"] = {"class_type": "KSampler", "inputs": {"seed": 100}}
    prompts = expand(apply_overrides(workflow, seed=7), 3)
    assert [p["2"]["inputs"]["seed"] for p in prompts] == [7, 8, 9]
    assert [p["7"]["inputs"]["seed"] for p in prompts] == [7, 8, 9]
    assert [p["2"]["inputs"]["seed"] for p in expand(workflow, 2)] == [0, 1], "the workflow's own seed"
    linked = {"2": {"class_type": "X", "inputs": {"seed": ["1", 0]}}}
    assert expand(linked, 2) == [linked, linked], "a linked seed is left alone"
    with pytest.raises(ClientError, match="--count 0"):
        expand(workflow, 0)


@pytest.mark.parametrize("legacy_combo", [False, True])
def test_check_passes_a_workflow_the_server_can_run(workflow, legacy_combo):
    assert check_workflow(workflow, object_info([MODEL, "tiny"], legacy_combo)) == []


def test_check_names_missing_node_types_and_models(workflow):
    info = object_info(["tiny-pixart", "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"])
    del info["PixArtQ_MemorySnapshot"]
    problems = check_workflow(apply_overrides(workflow, ["2.scheduler=heun"]), info)
    available = "available: tiny-pixart, PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"
    assert problems == [
        f"node 1 (PixArtQ_T5Encode) input 'model': '{MODEL}' is not on the server; {available}",
        f"node 2 (PixArtQ_Sampler) input 'model': '{MODEL}' is not on the server; {available}",
        "node 2 (PixArtQ_Sampler) input 'scheduler': 'heun' is not on the server; available: dpmsolver++, euler",
        f"node 3 (PixArtQ_VAEDecode) input 'model': '{MODEL}' is not on the server; {available}",
        "node 4: the server has no node type 'PixArtQ_MemorySnapshot' "
        "(is the pack, or the pack that provides it, installed in its custom_nodes?)",
    ]
    assert "available: (none)" in check_workflow(workflow, object_info([]))[0]


def test_a_model_the_server_lacks_points_at_model_option(workflow, monkeypatch):
    api = client.Client("http://127.0.0.1:1")
    monkeypatch.setattr(api, "get", lambda path: object_info(["tiny-pixart"]))
    with pytest.raises(ClientError) as refused:
        api.check(workflow)
    lines = str(refused.value).splitlines()
    assert lines[0] == "the workflow cannot run on http://127.0.0.1:1:" and len(lines) == 5
    assert lines[-1] == "  (--model NAME sets the model of every node that names one)"
    api.check(apply_overrides(workflow, model="tiny-pixart"))


def test_ui_format_workflow_is_refused(tmp_path):
    """A UI file is refused with a pointer to the bundled API files, which are where it says."""
    with pytest.raises(ClientError, match="UI-format workflow; queue the API format") as refused:
        client.load_workflow(REPO / "workflows" / "pixart_lowvram_basic.json")
    (folder,) = re.findall(r"the \*_api\.json files in (\S+)/\)", str(refused.value))
    assert REPO / folder == API_WORKFLOW.parent
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": {"inputs": {}}}))
    with pytest.raises(ClientError, match="not an API-format workflow"):
        client.load_workflow(bad)


def test_a_missing_workflow_file_is_named_with_a_bundled_one_to_try(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ClientError) as refused:
        client.load_workflow(missing)
    said = str(refused.value)
    assert said.startswith(f"the workflow {missing} cannot be read (No such file or directory); ")
    (example,) = re.findall(r"e\.g\. (\S+)$", said)
    assert REPO / example == API_WORKFLOW


def test_a_workflow_saved_with_the_old_names_is_upgraded(tmp_path):
    """Saved before the sampler's ``weights`` became ``quantization`` and the VAE's "(model folder)" became
    "(from model)": loaded under the current names, the values kept."""
    old = json.loads(API_WORKFLOW.read_text(encoding="utf-8"))
    sampler = old["2"]["inputs"]
    old["2"]["inputs"] = {
        ("weights" if key == "quantization" else key): value for key, value in sampler.items()
    }
    old["2"]["inputs"]["weights"] = "qfloat8"
    old["3"]["inputs"]["vae_file"] = "(model folder)"
    path = tmp_path / "old_api.json"
    path.write_text(json.dumps(old))
    loaded = client.load_workflow(path)
    assert "weights" not in loaded["2"]["inputs"] and loaded["2"]["inputs"]["quantization"] == "qfloat8"
    assert loaded["2"]["inputs"] == {**sampler, "quantization": "qfloat8"}, "the other inputs as they were"
    assert loaded["3"]["inputs"]["vae_file"] == "(from model)"
    assert loaded["1"] == old["1"] and loaded["5"] == old["5"], "other nodes are left as they were"


class FlakyServer:
    """A requests.Session stand-in: POST /prompt fails on the connection ``failures`` times (after
    ``reached`` of those the server had queued the prompt anyway); GET /queue and /history answer from
    what was queued."""

    def __init__(self, failures: int, reached: int = 0) -> None:
        self.failures, self.reached = failures, reached
        self.queued: list[str] = []
        self.posts = 0

    def post(self, url, json, timeout):
        self.posts += 1
        if self.posts <= self.failures:
            if self.posts <= self.reached:
                self.queued.append(json["prompt_id"])
            raise requests.ConnectionError("connection reset")
        self.queued.append(json["prompt_id"])
        response = requests.Response()
        response.status_code = 200
        return response

    def request(self, method, url, timeout, params=None):
        response = requests.Response()
        response.status_code = 200
        if url.endswith("/queue"):
            body = {"queue_running": [], "queue_pending": [[0, pid, {}, {}, []] for pid in self.queued]}
        else:
            body = {}
        response._content = client.json.dumps(body).encode()
        return response


@pytest.mark.parametrize(("failures", "reached", "posts"), [(1, 0, 2), (2, 0, 3), (1, 1, 1)])
def test_submit_retries_with_the_same_id_and_never_queues_twice(monkeypatch, failures, reached, posts):
    monkeypatch.setattr(client, "RETRY_PAUSE", 0)
    server = FlakyServer(failures, reached)
    api = client.Client("http://127.0.0.1:1")
    api.session = server
    api.submit({"1": {"class_type": "X", "inputs": {}}}, "the-id")
    assert server.queued == ["the-id"] and server.posts == posts


def test_submit_gives_up_after_its_attempts(monkeypatch):
    monkeypatch.setattr(client, "RETRY_PAUSE", 0)
    api = client.Client("http://127.0.0.1:1")
    api.session = FlakyServer(failures=client.SUBMIT_ATTEMPTS)
    with pytest.raises(ClientError, match=r"could not queue the prompt on http://127\.0\.0\.1:1"):
        api.submit({}, "the-id")


def test_refusal_text_names_each_nodes_error():
    response = requests.Response()
    response.status_code = 400
    response._content = json.dumps(
        {
            "error": {"message": "Prompt outputs failed validation", "details": ""},
            "node_errors": {
                "2": {
                    "class_type": "PixArtQ_Sampler",
                    "errors": [{"message": "Value not in list", "details": "model: 'x' not in [...]"}],
                }
            },
        }
    ).encode()
    assert client.refusal_text(response) == (
        "ComfyUI refused the prompt: Prompt outputs failed validation\n"
        "  node 2 (PixArtQ_Sampler): Value not in list: model: 'x' not in [...]"
    )


class UnreachableAfterPost(FlakyServer):
    """The first POST fails on the connection and the server then stops answering."""

    def request(self, method, url, timeout, params=None):
        raise requests.ConnectionError("connection refused")


def test_submit_does_not_post_again_while_it_cannot_tell_whether_the_first_landed(monkeypatch):
    monkeypatch.setattr(client, "RETRY_PAUSE", 0)
    server = UnreachableAfterPost(failures=1, reached=1)
    api = client.Client("http://127.0.0.1:1")
    api.session = server
    with pytest.raises(ClientError, match="could not queue the prompt"):
        api.submit({}, "the-id")
    assert server.posts == 1 and server.queued == ["the-id"]


class QuietSocket:
    """A websocket that hands out ``messages`` and then times out, as a quiet server's does."""

    def __init__(self, messages: list[dict]):
        self.messages = [json.dumps(message) for message in messages]

    def settimeout(self, seconds: float) -> None:
        assert seconds > 0

    def recv(self) -> str:
        if not self.messages or self.messages[0] == json.dumps(QUIET):
            if self.messages:
                self.messages.pop(0)
            raise client.websocket.WebSocketTimeoutException("quiet")
        return self.messages.pop(0)


# In QuietSocket's messages: the socket falls quiet there (a read window ends) before the messages after it.
QUIET = {"quiet": True}


def follow(
    monkeypatch, messages: list[dict], written_when_left: int, on_message=None
) -> tuple[dict, list[int]]:
    """``Client.wait`` on a prompt whose history entry exists once at most ``written_when_left`` of its
    messages are still to come; the entry and how many messages were left at each /history read. Sleeping
    fails the test: the client must not have to guess when the entry is written."""
    ws, reads = QuietSocket(messages), []
    api = client.Client("http://127.0.0.1:1")

    def get(path: str) -> dict:
        assert path == "/history/p1"
        reads.append(len(ws.messages))
        return {"p1": {"status": {"status_str": "success"}}} if len(ws.messages) <= written_when_left else {}

    monkeypatch.setattr(api, "get", get)
    monkeypatch.setattr(client.time, "sleep", lambda seconds: pytest.fail(f"slept {seconds} s"))
    return api.wait(ws, "p1", 30.0, None, on_message), reads


def test_wait_reads_the_history_after_the_closing_message(monkeypatch):
    """ComfyUI sends execution_success, writes the history entry, then sends ``executing`` with no node: the
    entry is read once, after that last message (read at execution_success it was not there yet)."""
    messages = [
        {"type": "executing", "data": {"node": "1", "prompt_id": "p1"}},
        {"type": "executing", "data": {"node": "2", "prompt_id": "other"}},
        {"type": "execution_success", "data": {"prompt_id": "p1"}},
        {"type": "executing", "data": {"node": None, "prompt_id": "p1"}},
    ]
    entry, reads = follow(monkeypatch, messages, written_when_left=0)
    assert entry["status"]["status_str"] == "success" and reads == [0]


def test_wait_reads_the_history_when_no_closing_message_comes(monkeypatch):
    """A prompt that reports its end but whose closing message never reaches this client (another client's
    prompt id on an old server): the history is read once the socket falls quiet after the end."""
    monkeypatch.setattr(client, "CLOSING_GRACE", 0.05)
    entry, reads = follow(
        monkeypatch, [{"type": "execution_success", "data": {"prompt_id": "p1"}}], written_when_left=0
    )
    assert entry["status"]["status_str"] == "success" and reads == [0]


def test_wait_hands_on_the_closing_message_when_the_history_came_first(monkeypatch):
    """A read window that ends after the entry is written and before the closing message is read: the
    client reads that message before it returns, so ``on_message`` sees every message of the prompt (the
    benchmarks time each node from them)."""
    messages = [
        {"type": "executing", "data": {"node": "1", "prompt_id": "p1"}},
        QUIET,
        {"type": "executing", "data": {"node": None, "prompt_id": "p1"}},
    ]
    seen = []
    entry, reads = follow(
        monkeypatch, messages, written_when_left=1, on_message=lambda kind, data: seen.append(data["node"])
    )
    assert entry["status"]["status_str"] == "success" and reads == [1]
    assert seen == ["1", None]


def test_prompt_ids_are_canonical_uuids(monkeypatch):
    """ComfyUI 0.38 refuses a prompt id that is not a canonical UUID: the client makes only those, and
    refuses another one given to it before anything is posted."""
    posted = []
    api = client.Client("http://127.0.0.1:1")
    monkeypatch.setattr(api, "submit", lambda prompt, prompt_id: posted.append(prompt_id))
    done = {"status": {"status_str": "success", "completed": True}, "outputs": {}}
    monkeypatch.setattr(api, "wait", lambda *args, **kwargs: done)
    for _ in range(3):
        api.run(None, {}, Path("out"), 1.0, None)
    assert len(set(posted)) == 3
    assert all(str(uuid.UUID(prompt_id)) == prompt_id for prompt_id in posted)
    given = str(uuid.uuid4())
    assert api.run(None, {}, Path("out"), 1.0, None, prompt_id=given).prompt_id == given
    for bad in (given.upper(), given.replace("-", ""), f"{{{given}}}", "prompt-1"):
        with pytest.raises(ClientError, match="is not a canonical UUID, which ComfyUI's /prompt requires"):
            api.run(None, {}, Path("out"), 1.0, None, prompt_id=bad)
    assert len(posted) == 4, "a refused id is never posted"
