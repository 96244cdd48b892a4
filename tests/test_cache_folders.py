"""The folders the pack writes to of its own accord: one variable (PIXART_LOWVRAM_HOME) places them all,
PIXART_LOWVRAM_QUANT_CACHE moves the pre-quantized weights alone, the tests keep them out of the user's
home (and torch.compile's caches in the run's temporary folder), and a folder that cannot be written costs
a warning where it is optional (the pre-quantized weights: the run goes on without them) and one line
naming the fix where it is needed (the demo's model).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pixart_lowvram.cli import main as cli
from pixart_lowvram.core import folders, quant_cache, sampler, sampler_settings, text_encoder


def unwritable(tmp_path: Path) -> Path:
    """A folder no file can be made in. A read-only folder where permissions hold; root ignores them, so
    there a path under a regular file (mkdir and open fail there for anyone)."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        locked = tmp_path / "read-only"
        locked.mkdir()
        locked.chmod(0o555)
        folder = locked / "cache"
    else:
        (tmp_path / "a-file").write_text("not a folder")
        folder = tmp_path / "a-file" / "cache"
    if folders.unwritable(folder) is None:
        pytest.skip(f"no way found to make a folder unwritable here ({folder} can be written)")
    return folder


def cache_warnings(caplog: pytest.LogCaptureFixture, folder: Path) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.WARNING and str(folder) in record.getMessage()
    ]


def test_the_home_variable_places_the_pre_quantized_weights_too(monkeypatch, tmp_path):
    monkeypatch.delenv(quant_cache.ENV)
    monkeypatch.setenv(folders.HOME_ENV, str(tmp_path / "home"))
    assert folders.home() == tmp_path / "home"
    assert quant_cache.default_dir() == tmp_path / "home" / "quantized"
    # PIXART_LOWVRAM_QUANT_CACHE moves that one cache.
    monkeypatch.setenv(quant_cache.ENV, str(tmp_path / "elsewhere"))
    assert quant_cache.default_dir() == tmp_path / "elsewhere"
    assert folders.home() == tmp_path / "home"


def test_without_the_variables_both_are_in_the_users_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(quant_cache.ENV)
    monkeypatch.delenv(folders.HOME_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert folders.home() == tmp_path / "xdg" / "pixart_lowvram"
    assert quant_cache.default_dir() == tmp_path / "xdg" / "pixart_lowvram" / "quantized"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty is unset, as the XDG specification says
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert folders.home() == tmp_path / "user" / ".cache" / "pixart_lowvram"


def test_a_run_leaves_the_users_home_untouched(tmp_path, pack_home):
    """The demo as a new user runs it (builds its model, writes pre-quantized weights, draws the memory
    picture with matplotlib) in a process whose home is an empty folder, with PIXART_LOWVRAM_HOME set
    and no MPLCONFIGDIR or XDG folders: nothing appears in the home folder, and the pack's files,
    matplotlib's caches among them, are in the session's temporary pack home."""
    home = tmp_path / "home"
    home.mkdir()
    unset = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    argv = ["demo", "--steps", "1", "--device", "cpu", "--no-snapshot", "--out", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, "-m", "pixart_lowvram", *argv],
        cwd=tmp_path,
        env={**env, "HOME": str(home), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(home.rglob("*")) == []
    assert (tmp_path / "out" / "pixart_00001_memory.png").is_file()  # drawn with matplotlib
    assert list((pack_home / "matplotlib").glob("fontlist-*.json"))
    assert (pack_home / "random-tiny" / "model_index.json").is_file()
    made_from = [
        quant_cache.source_of(entry)["source"] for entry in quant_cache.entries(pack_home / "quantized")
    ]
    assert str(pack_home / "random-tiny" / "text_encoder") in made_from


def test_compiled_code_is_cached_in_the_sessions_temporary_folder(tmp_path_factory, compiler_caches):
    """inductor's cache and precompiled headers, for the tests and the processes they start, are in pytest's
    temporary folder (which a passing run deletes), not in the system's temporary folder, where they outlive
    the run (~150 MB after a run of this tier)."""
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir, triton_cache_dir

    base = tmp_path_factory.getbasetemp()
    assert Path(cache_dir()) == compiler_caches and compiler_caches.is_relative_to(base)
    assert Path(triton_cache_dir(0)).is_relative_to(base)
    assert Path(default_cache_dir()).is_relative_to(base)
    headers = getattr(codecache, "_HEADER_DIR", "")
    assert Path(headers).is_relative_to(base), (
        f"inductor's precompiled headers go to {headers!r}: see conftest"
    )
    assert Path(tempfile.gettempdir()).is_relative_to(base)
    code = (
        "import tempfile; from torch._inductor import codecache; "
        "from torch._inductor.runtime.cache_dir_utils import cache_dir; "
        "print(cache_dir(), codecache._HEADER_DIR, tempfile.gettempdir())"
    )
    started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    folder, headers, temporary = map(Path, started.stdout.split())
    assert folder == compiler_caches
    assert headers.is_relative_to(base) and temporary.is_relative_to(base)


@pytest.mark.parametrize("setting", ["--quant-cache", quant_cache.ENV, folders.HOME_ENV])
def test_an_unwritable_pre_quantized_cache_is_one_warning_and_the_run_goes_on(
    tiny_folder, tmp_path, monkeypatch, caplog, setting
):
    folder = unwritable(tmp_path)
    argv = ["generate", "--model", str(tiny_folder), "--out", str(tmp_path / "out"), "--steps", "1"]
    argv += ["--device", "cpu", "--no-snapshot", "--quantization", "none"]  # T5's nf4 uses the cache
    if setting == "--quant-cache":
        argv += ["--quant-cache", str(folder)]
    elif setting == quant_cache.ENV:
        monkeypatch.setenv(quant_cache.ENV, str(folder))
    else:
        monkeypatch.delenv(quant_cache.ENV)
        monkeypatch.setenv(folders.HOME_ENV, str(folder))
        folder = folder / "quantized"
    with caplog.at_level(logging.WARNING):
        assert cli.main(argv) == 0
    (warning,) = cache_warnings(caplog, folder)
    assert setting in warning and "going on without it" in warning and "--no-quant-cache" in warning
    assert "\n" not in warning
    assert (tmp_path / "out" / "pixart_00001.png").is_file()


def test_the_stages_go_on_when_their_cache_cannot_be_written(tiny, tmp_path, caplog):
    """The nodes hand the stages a cache folder (ComfyUI's models/pixart_lowvram/quantized, or
    PIXART_LOWVRAM_QUANT_CACHE) that nothing checked: a prompt goes on without it, one warning for both
    stages."""
    folder = unwritable(tmp_path)
    with caplog.at_level(logging.WARNING):
        embeds = text_encoder.encode(
            text_encoder.EncoderSettings(tiny, quantization="nf4", device="cpu", quant_cache=folder), "a cat"
        )
        settings = {"width": 64, "height": 64, "steps": 1, "device": "cpu"}
        sampler.sample(
            sampler_settings.SamplerSettings(tiny, quantization="qint8", quant_cache=folder, **settings),
            embeds,
        )
    (warning,) = cache_warnings(caplog, folder)
    assert quant_cache.ENV in warning and "going on without it" in warning


def run_demo(argv: list[str], env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pixart_lowvram", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_an_unwritable_home_stops_the_demo_at_once_with_the_fix(tmp_path):
    folder = unwritable(tmp_path)
    env = {**os.environ, folders.HOME_ENV: str(folder), "HF_HUB_OFFLINE": "1"}
    argv = ["demo", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "out")]
    proc = run_demo(argv, env, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: the random model cannot be written to {folder / 'random-tiny'} (")
    assert f"set {folders.HOME_ENV} to a writable folder" in line and "--model-dir" in line
    assert "building" not in proc.stderr  # refused before the seconds of building
    # Given with --model-dir, the fix named is that option.
    proc = run_demo([*argv, "--model-dir", str(folder / "m")], env, tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "give --model-dir a writable folder" in proc.stderr
    assert not (tmp_path / "out").exists()
