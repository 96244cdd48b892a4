"""The command line as a new user meets it: every mistake refused at once with one line (exit 2, no
traceback, nothing loaded, no image lost), help with defaults, option names that are the nodes' own, and
no other library's noise."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pixart_lowvram.cli import commands
from pixart_lowvram.cli import main as cli
from pixart_lowvram.core import devices, quant_cache, resolutions, sampler_settings, text_encoder

LONG_PROMPT = " ".join(f"word{i}" for i in range(400))  # > 300 tokens


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "PIXART_LOWVRAM_HOME": str(cwd / "home"),
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "pixart_lowvram", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def one_line_error(proc: subprocess.CompletedProcess, *parts: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def generate(tiny_folder: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(tiny_folder), "--out", str(tmp_path / "out"), "--steps", "1", *extra]


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch build")
def test_device_cuda_on_a_cpu_build_is_one_line_before_anything_loads(
    tiny_folder, tmp_path, load_spy, capsys
):
    assert cli.main(generate(tiny_folder, tmp_path, "--device", "cuda")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device 'cuda'") and "CPU build" in err and "cpu" in err
    assert err.count("\n") == 1
    assert load_spy.total() == 0
    # The demo refuses it before building its model.
    proc = run_cli("demo", "--device", "cuda", "--model-dir", str(tmp_path / "m"), cwd=tmp_path)
    one_line_error(proc, "device 'cuda'", "CPU build")
    assert not (tmp_path / "m").exists()


def test_an_unknown_device_name_is_refused():
    with pytest.raises(ValueError, match="device 'gpu0' is not a device name; use cpu, cuda or cuda:N"):
        devices.as_device("gpu0")


def test_out_naming_an_existing_file_is_refused_before_anything_loads(
    tiny_folder, tmp_path, load_spy, capsys
):
    image = tmp_path / "out"
    image.write_bytes(b"an earlier image")
    assert cli.main(generate(tiny_folder, tmp_path, "--device", "cpu")) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a file" in err and "give a folder" in err
    assert load_spy.total() == 0
    assert image.read_bytes() == b"an earlier image"


def test_out_inside_a_file_is_refused(tiny_folder, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    argv = [
        "generate",
        "--model",
        str(tiny_folder),
        "--out",
        str(tmp_path / "file" / "sub"),
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 2
    assert "which is a file" in capsys.readouterr().err


@pytest.mark.parametrize("side", ["--width", "--height"])
def test_a_zero_size_is_refused_like_any_other_bad_size(tiny_folder, tmp_path, load_spy, capsys, side):
    assert cli.main(generate(tiny_folder, tmp_path, "--device", "cpu", side, "0")) == 2
    err = capsys.readouterr().err
    assert f"{side.strip('-')} 0 is out of range; use 64..4096 pixels" in err
    assert load_spy.total() == 0


def test_width_and_height_default_to_the_model_size_and_resolution_is_an_option(tiny):
    parser = commands.build_parser()
    args = parser.parse_args(["generate", "--model", "m"])
    assert args.width is None and args.height is None and args.resolution == resolutions.CUSTOM_RESOLUTION
    settings = sampler_settings.SamplerSettings(tiny, device="cpu", quantization="none")
    assert (settings.width, settings.height) == (64, 64)  # the tiny model's native size
    wide = sampler_settings.SamplerSettings(tiny, width=128, device="cpu", quantization="none")
    assert (wide.width, wide.height) == (128, 64)
    native = sampler_settings.SamplerSettings(
        tiny, width=128, resolution="native", device="cpu", quantization="none"
    )
    assert (native.width, native.height) == (64, 64)


def test_option_names_are_the_nodes_and_the_old_flags_still_work():
    parser = commands.build_parser()
    args = parser.parse_args(
        ["generate", "--model", "m", "--quantization", "qfloat8", "--t5-quantization", "fp4"]
    )
    assert (args.quantization, args.t5_quantization) == ("qfloat8", "fp4")
    old = parser.parse_args(["generate", "--model", "m", "--quant", "none", "--t5-quant", "int8"])
    assert (old.quantization, old.t5_quantization) == ("none", "int8")


def test_generate_help_shows_the_defaults_and_every_scheme(tmp_path):
    proc = run_cli("generate", "--help", cwd=tmp_path)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for shown in (
        "(default: 20)",
        "(default: 4.5)",
        "(default: nf4)",
        "(default: qint8)",
        "(default: dpmsolver++)",
        "(default: the model's size)",
        "nf4-recipe: the notebook recipe's nf4",
        "qfloat8: optimum-quanto float8",
    ):
        assert shown in text, shown


def test_help_says_each_default_once_and_every_command_what_it_does(tmp_path):
    for command in ("demo", "generate", "cache", "queue"):
        proc = run_cli(command, "--help", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        text = " ".join(proc.stdout.split())
        for noise in ("(default: None)", "(default: False)", "(default: )", "(default: [])"):
            assert noise not in text, (command, noise)
        # Each option's default once: never two "(default: …)" in one option's help.
        assert not re.search(r"\(default: [^()]*\)[^-]*\(default:", text), command
    cache_help = " ".join(run_cli("cache", "--help", cwd=tmp_path).stdout.split())
    assert "Lists each entry with its size and the model it was made from" in cache_help
    # Compared without spaces: argparse wraps long paths at their hyphens.
    assert f"(default:{quant_cache.default_dir()})" in cache_help.replace(" ", "")
    main_help = " ".join(run_cli("--help", cwd=tmp_path).stdout.split())
    assert "PIXART_LOWVRAM_HOME" in main_help and quant_cache.ENV in main_help


@pytest.mark.parametrize("prompt", ["", "   "], ids=["empty", "spaces"])
def test_an_empty_prompt_is_said_once_and_the_image_is_made(tiny_folder, tmp_path, caplog, prompt):
    argv = generate(tiny_folder, tmp_path, "--device", "cpu", "--no-snapshot", "--prompt", prompt)
    with caplog.at_level(logging.WARNING):
        assert cli.main([*argv, "--quantization", "none", "--t5-quantization", "none"]) == 0
    said = [record.getMessage() for record in caplog.records if "prompt" in record.getMessage()]
    assert said == ["the prompt is empty: the image follows no text; give one with --prompt"]
    assert (tmp_path / "out" / "pixart_00001.png").is_file()


def test_the_demo_says_what_it_builds_and_that_its_image_is_noise(tmp_path):
    proc = run_cli(
        "demo", "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--steps", "1",
        "--device", "cpu", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "about 321 MB: its VAE is the full-size SDXL VAE" in proc.stderr
    assert "the weights are random, so the image is noise" in proc.stdout
    # bitsandbytes' notice about its optional CPU kernel is not shown (it reads like an error), nor
    # transformers' progress bars as the model is built and T5 loaded and saved pre-quantized.
    assert "gemm_4bit_forward" not in proc.stderr and "pip install kernels" not in proc.stderr
    assert "Loading weights" not in proc.stderr and "Writing model shards" not in proc.stderr
    # The cache listing names the model each entry was made from.
    listing = run_cli("cache", cwd=tmp_path)
    assert str(tmp_path / "m" / "text_encoder") in listing.stdout, listing.stdout


def test_a_long_prompt_warns_once_in_a_few_lines(tiny, caplog):
    settings = text_encoder.EncoderSettings(tiny, quantization="none", device="cpu", precision=torch.float32)
    warnings: list[str] = []
    pipeline_logger = logging.getLogger("diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma")
    filters = list(pipeline_logger.filters)
    with caplog.at_level(logging.WARNING):
        text_encoder.encode(settings, LONG_PROMPT, on_warning=warnings.append)
    assert len(warnings) == 1 and "prompt is" in warnings[0] and len(warnings[0]) < 400
    logged = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert logged == warnings  # diffusers' own warning, which quotes the whole cut text, is not logged
    # Only for the encode: diffusers' logger is left as it was.
    assert pipeline_logger.filters == filters


def test_core_messages_name_no_node_of_the_pack():
    """The ComfyUI-free core speaks of options and stages; the node adapters add ComfyUI's own words.
    (client.py is the API client for ComfyUI's server: it maps the nodes' old names in saved workflows.)"""
    core, command_line = Path(devices.__file__).parent, Path(cli.__file__).parent
    names = (
        "Quantized T5 Encode",
        "Quanto PixArt Sampler",
        "VAE Decode (PixArt-Σ)",
        "Free VRAM",
        "(model folder)",
    )
    for path in (p for folder in (core, command_line) for p in folder.rglob("*.py") if p.name != "client.py"):
        text = path.read_text(encoding="utf-8")
        for name in names:
            assert name not in text, f"{path.name} names {name!r}"


def test_cache_listing_of_an_empty_folder(tmp_path, capsys):
    assert cli.main(["cache", "--dir", str(tmp_path)]) == 0
    assert f"pre-quantized weight cache: {tmp_path} (0 entries)" in capsys.readouterr().out
    assert quant_cache.entries(tmp_path) == []


def test_the_command_line_names_itself_as_it_was_started(tmp_path):
    script = Path(sys.executable).with_name("pixart-lowvram")  # the entry point .ci/setup installs
    assert script.is_file(), f"{script} is not installed"
    installed = subprocess.run(
        [str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.startswith("usage: pixart-lowvram "), installed.stdout[:200]
    assert run_cli("--help", cwd=tmp_path).stdout.startswith("usage: python -m pixart_lowvram ")


def test_every_bad_input_is_said_at_once_before_anything_loads(tiny_folder, tmp_path, load_spy, capsys):
    argv = generate(tiny_folder, tmp_path, "--device", "cpu", "--width", "1000", "--height", "7")
    assert cli.main([*argv, "--cfg", "-1", "--tiling", "on", "--lora", "style.safetensors:strong"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    # The LoRAs are checked first (before the demo would build its model), the stages' inputs together.
    assert "the strength 'strong' is not a number" in err
    assert cli.main([*argv, "--cfg", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for said in (
        "cfg -1.0 is out of range",
        "width 1000 is not a multiple of 16; use 992 or 1008.",
        "height 7 is out of range; use 64..4096 pixels.",
    ):
        assert said in err, err
    assert load_spy.total() == 0


def test_verbose_says_what_each_stage_loads(tiny_folder, tmp_path, caplog):
    argv = generate(tiny_folder, tmp_path, "--device", "cpu", "--no-snapshot", "--t5-quantization", "none")
    with caplog.at_level(logging.INFO):
        assert cli.main(["-v", *argv, "--quantization", "none"]) == 0
    said = [record.getMessage() for record in caplog.records if " loads " in record.getMessage()]
    folder = tiny_folder.resolve()
    assert len(said) == 3, said
    for line, stage, component in zip(
        said, ("t5_encode", "sample", "vae_decode"), ("text_encoder", "transformer", "vae"), strict=True
    ):
        assert line.startswith(f"{stage} loads {folder / component}: quantization none, torch."), line
        assert line.endswith(" on cpu"), line


def test_queue_without_a_running_comfyui_says_how_to_start_one(tmp_path, capsys):
    import socket

    from test_workflows import api_file

    with socket.socket() as free:  # a port that nothing listens on once it is closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    server = f"http://127.0.0.1:{port}"
    assert cli.main(["queue", str(api_file("basic")), "--server", server]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: could not reach ComfyUI at {server}") and err.count("\n") == 1
    assert "Is ComfyUI running there? Start it in its folder with `python main.py`" in err
    assert "--server" in err.split("Is ComfyUI running there?")[1]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--size", "1024"], "error: --size '1024': expected WIDTHxHEIGHT in pixels, e.g. 768x1344"),
        (["--size", "0x768"], "error: --size '0x768': width and height must be above 0, e.g. 768x1344"),
        (
            ["--size", "100x100"],
            "error: --size '100x100': width 100 is not a multiple of 16; use 96 or 112. "
            "height 100 is not a multiple of 16; use 96 or 112.",
        ),
    ],
)
def test_queue_refuses_a_bad_size_before_it_reaches_a_server(capsys, args, said):
    from test_workflows import api_file

    server = "http://127.0.0.1:1"  # never asked: the size is refused first
    assert cli.main(["queue", str(api_file("basic")), "--server", server, "--model", "m", *args]) == 2
    assert capsys.readouterr().err == said + "\n"


def test_queue_names_the_workflow_file_it_cannot_find(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert cli.main(["queue", str(missing), "--server", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the workflow {missing} cannot be read (No such file or directory); ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--frobnicate"], "error: unrecognized arguments: --frobnicate"),
        (["--frobnicate", "cache"], "error: unrecognized arguments: --frobnicate"),
        (["cache", "--frobnicate", "x"], "error: unrecognized arguments: --frobnicate x"),
        ([], "error: the following arguments are required: command"),
    ],
)
def test_an_unknown_option_is_named(capsys, argv, said):
    with pytest.raises(SystemExit) as stopped:
        commands.main(argv)
    assert stopped.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage.startswith("usage: ") and error.endswith(said)


def test_usage_lists_every_option_of_generate():
    """docs/USAGE.md's option table names each of generate's options (old names included)."""
    usage = (Path(__file__).resolve().parents[1] / "docs" / "USAGE.md").read_text(encoding="utf-8")
    table = usage.split("| option | what |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(--[a-z0-9-]+)", table))
    generate_parser = commands.build_parser()._subparsers._group_actions[0].choices["generate"]
    options = {flag for action in generate_parser._actions for flag in action.option_strings}
    assert sorted(options - named - {"-h", "--help"}) == []
