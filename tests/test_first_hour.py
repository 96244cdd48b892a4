"""A new user's first hour: setup that says what it does and prints no deprecation banners, package
metadata that claims no publication that has not happened, and a quantized-weight cache whose entries
say which model they were made from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from pixart_lowvram.core import quant_cache, text_encoder

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it():
    config = pyproject()
    assert config["project"]["license"] == "Apache-2.0"
    (requirement,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    assert requirement.replace(" ", "").startswith("setuptools>=")
    assert int(requirement.split(">=")[1].split(".")[0]) >= 77  # the first to read `license = "SPDX"`


def test_pyproject_applies_without_setuptools_warnings():
    """What printed the license banner three times during setup: no warning of any kind now."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"


def test_registry_metadata_is_kept_and_no_unpublished_repository_is_named():
    config = pyproject()
    comfy = config["tool"]["comfy"]
    assert {"PublisherId", "DisplayName", "Icon", "includes"} <= set(comfy)
    assert comfy["DisplayName"] == "PixArt-Σ low VRAM"
    assert not config["project"].get("urls", {}).get("Repository"), (
        "the pack is not published yet; name its repository here (and change this test) once it is"
    )


def test_setup_says_what_it_does_and_prints_no_banner():
    """A re-run (``.venv`` exists): its own ``setup:`` lines on stderr and no setuptools banner."""
    if not (ROOT / ".venv" / "bin" / "python").is_file():
        pytest.skip("no .venv: run `bash .ci/setup` once first (a first run takes about a minute)")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONWARNINGS")}
    done = subprocess.run(
        ["bash", ".ci/setup"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines and lines[0].startswith("setup: "), done.stderr
    assert lines[-1].startswith("setup: ready"), done.stderr
    for noise in ("BuildBackendWarning", "deprecated", "Traceback", "!!"):
        assert noise not in done.stderr, done.stderr
    assert done.stdout == ""


# The quantized-weight cache records what each entry was made from.


def encode(source, cache_dir, scheme="nf4"):
    settings = text_encoder.EncoderSettings(source, quantization=scheme, device="cpu", quant_cache=cache_dir)
    return text_encoder.encode(settings, "a red cat").prompt_embeds


@pytest.fixture
def no_rebuilding(monkeypatch):
    """Fails a test in which the quantized cache builds (quantizes) instead of loading its entry."""
    load_or_build = quant_cache.load_or_build

    def refuse():
        raise AssertionError("quantized again although the entry exists")

    def load_only(folder, load, build, save):
        return load_or_build(folder, load, refuse, save)

    monkeypatch.setattr(quant_cache, "load_or_build", load_only)


@pytest.fixture
def weights(tmp_path):
    """A small stand-in for a model's weights folder."""
    folder = tmp_path / "models" / "PixArt-Sigma-XL-2-1024-MS" / "text_encoder"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").write_text("{}")
    return folder


def build_entry(root: Path, source: Path, scheme: str = "nf4") -> Path:
    folder = quant_cache.entry(root, "text_encoder", source, {"scheme": scheme, "dtype": torch.bfloat16})
    quant_cache.load_or_build(
        folder,
        load=lambda path: json.loads((path / "model.json").read_text()),
        build=lambda: {"quantized": True},
        save=lambda model, path: (path / "model.json").write_text(json.dumps(model)),
    )
    return folder


def test_source_json_is_in_the_entry_before_it_is_renamed_into_place(weights, tmp_path, monkeypatch):
    renamed = []
    original = Path.rename

    def rename(self, target):
        renamed.append((Path(target), sorted(p.name for p in self.iterdir())))
        return original(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    folder = build_entry(tmp_path / "cache", weights)
    assert renamed == [(folder, ["model.json", "source.json"])]

    record = json.loads((folder / "source.json").read_text())
    assert record["component"] == "text_encoder"
    assert Path(record["source"]) == weights.absolute()
    assert record["settings"] == {"dtype": "torch.bfloat16", "scheme": "nf4"}
    assert set(record["versions"]) == set(quant_cache.LIBRARIES)
    assert record["created"]
    assert quant_cache.source_of(folder) == record
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_describe_names_the_component_the_source_and_the_scheme(weights, tmp_path):
    line = quant_cache.describe(build_entry(tmp_path / "cache", weights, "int8"))
    assert line.startswith(f"text_encoder from {weights.absolute()}, int8, made ")
    assert "\n" not in line and "stale" not in line and "gone" not in line


def test_describe_marks_an_entry_whose_source_changed_or_went(weights, tmp_path):
    folder = build_entry(tmp_path / "cache", weights)
    stat = (weights / "model.safetensors").stat()
    os.utime(weights / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert "stale" in quant_cache.describe(folder)
    shutil.rmtree(weights)
    assert "source gone" in quant_cache.describe(folder)


def test_leftovers_of_interrupted_writes_are_not_listed_as_entries(weights, tmp_path):
    folder = build_entry(tmp_path / "cache", weights)
    (tmp_path / "cache" / f"{folder.name}.abc123.partial").mkdir()
    assert quant_cache.entries(tmp_path / "cache") == [folder]


def test_a_quantized_t5_entry_says_which_model_it_came_from(tiny, tmp_path):
    encode(tiny, tmp_path)
    (entry,) = quant_cache.entries(tmp_path)
    assert (entry / "source.json").is_file()
    record = quant_cache.source_of(entry)
    assert Path(record["source"]).resolve() == (tiny.path / "text_encoder").resolve()
    assert record["settings"]["scheme"] == "nf4"
    assert quant_cache.describe(entry).startswith(f"text_encoder from {record['source']}, nf4, made ")


def test_an_entry_from_an_older_version_is_described_as_unknown_and_still_loads(tiny, tmp_path, request):
    first = encode(tiny, tmp_path)
    (entry,) = quant_cache.entries(tmp_path)
    (entry / "source.json").unlink()  # as entries were written before they recorded their source
    assert quant_cache.source_of(entry) is None
    assert quant_cache.describe(entry) == f"text_encoder {quant_cache.UNKNOWN_SOURCE}"
    assert "source unknown" in quant_cache.describe(entry)

    request.getfixturevalue("no_rebuilding")
    assert torch.equal(encode(tiny, tmp_path), first)
    assert quant_cache.entries(tmp_path) == [entry]


def test_an_unreadable_source_json_does_not_break_listing_or_loading(tiny, tmp_path, request):
    first = encode(tiny, tmp_path)
    (entry,) = quant_cache.entries(tmp_path)
    (entry / "source.json").write_text("{not json")
    assert "source unknown" in quant_cache.describe(entry)
    request.getfixturevalue("no_rebuilding")
    assert torch.equal(encode(tiny, tmp_path), first)
