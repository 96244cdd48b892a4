"""Safety: weights are read through safetensors only and nothing is unpickled; file names cannot leave the
output folder; the network is used only when the user chose a hub id, and never with HF_HUB_OFFLINE.

Covered elsewhere: single .pt/.bin/.ckpt files refused for t5_file (test_single_file_t5.py),
transformer_file (test_single_file_transformer.py) and vae_file (test_cache_host.py), which also shows
a VAE file's config is never fetched; ComfyUI refusing an unsafe prefix (test_comfyui_server.py)."""

from __future__ import annotations

import ast
import pickle
import socket
from pathlib import Path

import pytest
import torch

from pixart_lowvram.core import (
    measure,
    models,
    outputs,
    sampler,
    sampler_settings,
    text_encoder,
    timeline,
    vae,
)
from pixart_lowvram.core.models import resolve_model

REPO = Path(__file__).resolve().parents[1]
FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}
UNPICKLERS = {
    ("pickle", "load"),
    ("pickle", "loads"),
    ("pickle", "Unpickler"),
    ("marshal", "loads"),
    ("dill", "load"),
    ("dill", "loads"),
    ("joblib", "load"),
    ("numpy", "load"),
    ("np", "load"),
}


def package_sources() -> list[Path]:
    """Every Python file the package ships (the repository root is the package), tests excluded."""
    skip = {".venv", "tests", ".git"}
    return sorted(p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts))


def calls(path: Path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Call)]


def dotted(node: ast.expr) -> tuple[str, ...]:
    if isinstance(node, ast.Attribute):
        return (*dotted(node.value), node.attr)
    return (node.id,) if isinstance(node, ast.Name) else ()


def test_the_scan_sees_the_package():
    names = {p.relative_to(REPO).as_posix() for p in package_sources()}
    assert {"core/models.py", "nodes/sampler.py", "benchmarks/harness.py"} <= names


def test_nothing_is_unpickled():
    found = []
    for path in package_sources():
        for call in calls(path):
            name = dotted(call.func)
            if name[-2:] in UNPICKLERS:
                found.append(f"{path.relative_to(REPO)}:{call.lineno} {'.'.join(name)}")
            if name[-2:] == ("torch", "load"):
                weights_only = [k.value for k in call.keywords if k.arg == "weights_only"]
                if not (
                    weights_only
                    and isinstance(weights_only[0], ast.Constant)
                    and weights_only[0].value is True
                ):
                    found.append(
                        f"{path.relative_to(REPO)}:{call.lineno} torch.load without weights_only=True"
                    )
    assert not found, found


def test_the_scan_would_see_an_unpickler(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle, torch\npickle.load(f)\ntorch.load(p)\ntorch.load(p, weights_only=False)\n")
    names = [dotted(call.func) for call in calls(bad)]
    assert ("pickle", "load") in names and names.count(("torch", "load")) == 2


def test_every_model_folder_load_asks_for_safetensors():
    # from_pretrained falls back to a pickled .bin when no safetensors file is there, unless told not to.
    for module in ("core/text_encoder.py", "core/transformer.py", "core/vae.py"):
        loads = [
            c
            for c in calls(REPO / module)
            if isinstance(c.func, ast.Attribute) and c.func.attr == "from_pretrained"
        ]
        weights_loads = [c for c in loads if "Tokenizer" not in ".".join(dotted(c.func))]
        assert weights_loads, module
        for call in weights_loads:
            assert any(
                k.arg == "use_safetensors" and getattr(k.value, "value", None) is True for k in call.keywords
            ), f"{module}:{call.lineno}"


# --- a pickle in a model folder ------------------------------------------------------------------------


class Evil:
    """Unpickling this records that it happened (what a malicious pickle would run instead)."""

    ran: list[str] = []

    def __reduce__(self):
        return (Evil.ran.append, ("unpickled",))


WEIGHTS = {
    "text_encoder": ("model.safetensors", "pytorch_model.bin"),
    "transformer": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"),
    "vae": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"),
}


def run(stage, source, reference):
    if stage == "text_encoder":
        settings = text_encoder.EncoderSettings(source, **FP32)
        return text_encoder.encode(settings, reference.prompt, reference.negative)
    if stage == "transformer":
        settings = sampler_settings.SamplerSettings(source, **reference.settings, **FP32)
        return sampler.sample(settings, reference.embeds)
    settings = vae.DecoderSettings(source, device="cpu", precision=torch.float32)
    return vae.decode(settings, reference.latents)


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    Evil.ran.clear()


@pytest.mark.parametrize("stage", list(WEIGHTS))
def test_a_pickle_in_a_model_folder_is_refused_unopened(
    tiny_folder, reference, load_spy, tmp_path, no_unpickling, stage
):
    folder = tmp_path / "pickled"
    folder.mkdir()
    for entry in tiny_folder.iterdir():
        if entry.name != stage:
            (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (folder / stage).mkdir()
    safetensors, pickled = WEIGHTS[stage]
    for file in (tiny_folder / stage).iterdir():
        if file.name != safetensors:
            (folder / stage / file.name).symlink_to(file)
    with open(folder / stage / pickled, "wb") as f:
        pickle.dump({"weight": Evil()}, f)

    with pytest.raises(FileNotFoundError) as info:
        run(stage, resolve_model(str(folder)), reference)
    message = str(info.value)
    assert f"only {pickled}, a pickle format" in message and ".safetensors weights only" in message, message
    assert Evil.ran == []
    assert load_spy.total() == 0


def test_a_hub_download_skips_pickled_weights(tmp_path, monkeypatch):
    asked = {}

    def fake_download(repo_id, **kwargs):
        asked.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    models.ModelSource("x/y", hub_id="x/y")._download(["transformer"])
    assert asked["repo_id"] == "x/y" and "transformer/*" in asked["allow_patterns"]
    assert {"*.bin", "*.pt", "*.ckpt"} <= set(asked["ignore_patterns"])


# --- file names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix",
    [
        "../escape",
        "..",
        "/tmp/abs",
        "C:\\abs",
        "a/../../b",
        "~/x",
        "a\nb",
        "a\x00b",
        "é",
        "a b",
        "x" * 101,
        "..",
    ],
)
def test_report_names_cannot_leave_the_output_folder(tmp_path, prefix):
    output = tmp_path / "output"
    with pytest.raises(ValueError, match="filename_prefix"):
        timeline.write_record(measure.MemoryReport(), output, prefix)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) in ([], [Path("output")])


def test_report_files_stay_in_the_output_folder(tmp_path):
    output = tmp_path / "output"
    record = timeline.write_record(measure.MemoryReport(), output, "pixart.memory-1")
    assert record.files and all(p.resolve().parent == output.resolve() for p in record.files)
    assert outputs.next_stem(output, "pixart.memory-1").parent == output


# --- the network ---------------------------------------------------------------------------------------


@pytest.fixture
def connections(monkeypatch) -> list[tuple]:
    """Every attempt to open a network connection, refused (the attempt is recorded, so an error a library
    wraps cannot hide it)."""
    attempts: list[tuple] = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
        raise OSError("network access refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def online(monkeypatch, is_online: bool) -> None:
    import huggingface_hub.constants

    if is_online:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", not is_online)


def test_a_local_model_never_touches_the_network_even_online(
    tiny_folder, reference, tmp_path, connections, monkeypatch
):
    online(monkeypatch, True)
    # A local copy kept under a hub id's repository name is found, not fetched.
    (tmp_path / "PixArt-Sigma-XL-2-1024-MS").symlink_to(tiny_folder, target_is_directory=True)
    source = resolve_model(models.HUB_1024, [tmp_path])
    assert source.path is not None and source.hub_id is None
    embeds = text_encoder.encode(
        text_encoder.EncoderSettings(source, **FP32), reference.prompt, reference.negative
    )
    latents = sampler.sample(sampler_settings.SamplerSettings(source, **reference.settings, **FP32), embeds)
    images = vae.decode(vae.DecoderSettings(source, device="cpu", precision=torch.float32), latents)
    assert torch.equal(images, reference.images)
    assert connections == []


def test_with_hf_hub_offline_a_hub_id_is_not_fetched(tmp_path, connections, monkeypatch):
    online(monkeypatch, False)
    source = resolve_model("pixart-lowvram-tests/not-here", [tmp_path])
    with pytest.raises(FileNotFoundError) as info:
        source.config("transformer")
    assert "HF_HUB_OFFLINE" in str(info.value) and str(tmp_path) in str(info.value)
    assert connections == []


def test_online_a_hub_id_is_the_only_thing_fetched(tmp_path, connections, monkeypatch):
    online(monkeypatch, True)
    source = resolve_model("pixart-lowvram-tests/not-here", [tmp_path])
    with pytest.raises(FileNotFoundError, match="could not be downloaded"):
        source.config("transformer")
    assert connections, "a chosen hub id is fetched when the machine is online"
