"""core/ and cli/ never import ComfyUI, core/ and nodes/ never import cli/, importing the pack has no side
effects (no CUDA initialisation), and tools/ and benchmarks/ import nothing from tests/."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fresh_python import probe

COMFY_MODULES = ("comfy", "comfy_api", "folder_paths", "server", "nodes", "comfy_execution", "execution")

# Runs in a fresh interpreter: ComfyUI's module names are made unimportable before the pack is
# imported, so an import of any of them anywhere in core fails loudly instead of finding a module.
PROBE = textwrap.dedent(
    """
    import importlib, importlib.abc, json, pkgutil, sys

    BLOCKED = set(json.loads(sys.argv[1]))
    attempts = []

    class NoComfyUI(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                attempts.append(name)
                raise ImportError(f"{name} is blocked: core must not need ComfyUI")
            return None

    sys.meta_path.insert(0, NoComfyUI())

    import torch
    import pixart_lowvram
    import pixart_lowvram.core

    imported = ["pixart_lowvram", "pixart_lowvram.core"]
    for info in pkgutil.walk_packages(pixart_lowvram.core.__path__, "pixart_lowvram.core."):
        importlib.import_module(info.name)
        imported.append(info.name)
    cli_loaded_by_core = sorted(m for m in sys.modules if m.startswith("pixart_lowvram.cli"))

    import pixart_lowvram.cli

    imported.append("pixart_lowvram.cli")
    for info in pkgutil.walk_packages(pixart_lowvram.cli.__path__, "pixart_lowvram.cli."):
        importlib.import_module(info.name)
        imported.append(info.name)

    print(json.dumps({
        "imported": imported,
        "attempts": attempts,
        "cli_loaded_by_core": cli_loaded_by_core,
        "comfy_loaded": sorted(
            m for m in sys.modules if m.split(".")[0] in BLOCKED
        ),
        "cuda_initialized": torch.cuda.is_initialized(),
    }))
    """
)


def test_core_imports_without_comfyui(tmp_path: Path) -> None:
    # cwd outside the repository, so the repository root's own nodes/ is not importable as `nodes`.
    result = probe(PROBE, json.dumps(COMFY_MODULES), cwd=tmp_path)

    expected = {f"pixart_lowvram.cli.{name}" for name in ("client", "commands", "main", "random_model")} | {
        f"pixart_lowvram.core.{name}"
        for name in (
            "devices",
            "measure",
            "models",
            "outputs",
            "pool",
            "quant",
            "quant.base",
            "quant.bitsandbytes",
            "quant.quanto",
            "sampler",
            "single_files",
            "text_encoder",
            "vae",
        )
    }
    assert expected <= set(result["imported"]), "every core and cli submodule is imported by the probe"
    assert result["cli_loaded_by_core"] == [], "core must not import the command line"
    assert result["attempts"] == [], f"core tried to import ComfyUI modules: {result['attempts']}"
    assert result["comfy_loaded"] == []
    assert result["cuda_initialized"] is False, "importing the pack must not initialise CUDA"


def test_nodes_do_not_import_the_command_line():
    """The nodes run inside ComfyUI: the command line, its API client and the test models stay out of it."""
    import ast

    root = Path(__file__).resolve().parent.parent
    nodes = [
        (path, ".".join(("pixart_lowvram", *path.parent.relative_to(root).parts)))
        for path in sorted((root / "nodes").rglob("*.py"))
    ]
    for path, package in [*nodes, (root / "__init__.py", "pixart_lowvram")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(part for part in (base, node.module or "") if part)
                names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            imported = [name for name in names if name.split(".")[:2] == ["pixart_lowvram", "cli"]]
            assert imported == [], f"{path.name} imports {imported[0]}"


def test_the_supported_comfyui_range():
    import pixart_lowvram

    minimum = ".".join(map(str, pixart_lowvram.MIN_COMFYUI))
    for supported in (minimum, "0.8.0", "0.33.0", "1.0.0", None, "unknown"):
        assert pixart_lowvram.unsupported_comfyui(supported) is None, supported
    line = pixart_lowvram.unsupported_comfyui("0.3.9")
    assert f"needs ComfyUI {minimum} or newer and found ComfyUI 0.3.9" in line and "Update ComfyUI" in line
    assert "\n" not in line
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'requires-comfyui = ">={minimum}"' in pyproject


def test_inside_an_older_comfyui_the_import_logs_one_line_and_no_traceback(tmp_path: Path) -> None:
    code = (
        "import logging, sys, types\n"
        "logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "sys.modules['comfyui_version'] = types.SimpleNamespace(__version__='0.3.10')\n"
        "import pixart_lowvram\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR PixArt-Σ low VRAM needs ComfyUI"), proc.stderr
    # Outside ComfyUI (no comfyui_version module) nothing is said.
    quiet = subprocess.run(
        [sys.executable, "-c", "import pixart_lowvram"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert quiet.returncode == 0 and quiet.stderr == ""


def core_imports() -> dict[str, set[str]]:
    """Each core module (``sampler``, ``quant.compute`` …) and the core modules it imports anywhere in its
    file: at the top, inside functions, or for type checking only (an import cycle all the same to a
    reader). A module's own parent packages are not counted: Python imports them before it in any case."""
    import ast

    core = Path(__file__).resolve().parent.parent / "core"
    names = {
        ".".join(path.relative_to(core).with_suffix("").parts).removesuffix("__init__").rstrip("."): path
        for path in core.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parents = {".".join(name.split(".")[:i]) for i in range(len(name.split(".")))}
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = [part for part in package.split(".") if part]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            elif (node.module or "").startswith("pixart_lowvram.core"):
                base = node.module.removeprefix("pixart_lowvram.core").lstrip(".")
            else:
                continue
            candidates = [base, *(f"{base}.{alias.name}".lstrip(".") for alias in node.names)]
            imported |= {module for module in candidates if module in names and module not in parents}
        graph[name] = imported - {name}
    return graph


def test_core_has_no_import_cycle():
    """The transformer's settings and loading do not reach back into the sampler's modules that run them,
    and no other core module imports one that imports it back."""
    graph = core_imports()
    sampler = {"sampler", "sampler_settings", "transformer_run"}
    assert not sampler & graph["transformer"], "core/transformer.py imports a module of the sampler's"
    # The probe reads the imports it is meant to read.
    assert "transformer" in graph["sampler_settings"] and "transformer" in graph["transformer_run"]
    assert {"sampler_settings", "transformer_run"} <= graph["sampler"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for module in graph[start] - seen:
            seen.add(module)
            if module == goal or reaches(module, goal, seen):
                return True
        return False

    cycles = sorted(f"{a} -> {b}" for a in graph for b in graph[a] if reaches(b, a, set()))
    assert cycles == [], f"core imports in a circle: {cycles}"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each absolute import in ``path``: ``import a.b`` and ``from a.b import c`` (as
    ``a.b``), ``importlib.import_module("a.b")`` with a constant name, and a constant path part ``"tests"``
    (a folder put on sys.path, as ``REPO / "tests"``), reported as the module ``tests``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Constant) and node.value == "tests":
            found.append((node.lineno, "tests"))
    return found


def imports_of(files: list[Path], modules: set[str], root: Path) -> list[str]:
    """Where ``files`` import one of ``modules`` (by its top-level name): "path:line imports module"."""
    return [
        f"{path.relative_to(root).as_posix()}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(path)
        if module.split(".")[0] in modules
    ]


@pytest.mark.parametrize("folder", ["tools", "benchmarks"])
def test_tools_and_benchmarks_import_nothing_from_tests(folder: str) -> None:
    """What the tests share with the benchmarks and tools/ (the ComfyUI server, the tiny workflows' settings,
    the VAE layouts) lives in tools/, which the tests import (pyproject's pytest pythonpath); tools/ and
    benchmarks/ never import a module of tests/, whose helpers may assume pytest and its fixtures."""
    root = Path(__file__).resolve().parents[1]
    tests = {path.stem for path in (root / "tests").glob("*.py")} | {"tests"}
    assert {"comfyui_support", "conftest", "test_import_boundary"} <= tests
    files = sorted((root / folder).rglob("*.py"))
    assert files, f"no Python file under {folder}/"
    imports = imports_of(files, tests, root)
    assert imports == [], f"{folder}/ imports modules of tests/ (move what both need to tools/): {imports}"


def test_the_import_scan_reads_every_kind_of_import(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text(
        textwrap.dedent(
            """
            import importlib, sys
            import comfyui_support as support
            from server_sequence import Settings
            from . import sibling
            sys.path.append(str(REPO / "tests"))
            importlib.import_module("test_workflows")
            """
        ),
        encoding="utf-8",
    )
    modules = {module for _line, module in imported_modules(source)}
    assert modules == {
        "importlib",
        "sys",
        "comfyui_support",
        "server_sequence",
        "tests",
        "test_workflows",
    }


def test_the_pack_imports_nothing_from_tools_or_tests() -> None:
    """The published archive leaves tools/ and tests/ out (.comfyignore, bash .ci/publish): the package
    (``__init__.py``, core/, nodes/, cli/) imports none of their modules."""
    root = Path(__file__).resolve().parents[1]
    outside = {path.stem for folder in ("tools", "tests") for path in (root / folder).glob("*.py")}
    outside |= {"tools", "tests"}
    assert {"comfy_server", "tiny_workflows", "comfyui_support"} <= outside
    files = [
        root / "__init__.py",
        *(p for f in ("core", "nodes", "cli") for p in sorted((root / f).rglob("*.py"))),
    ]
    imports = imports_of(files, outside, root)
    assert imports == [], f"the pack imports what its archive leaves out: {imports}"
