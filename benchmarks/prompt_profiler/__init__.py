"""A node pack of no nodes for benchmarks: a server's prompts timed and profiled where they run.

``benchmarks/warm.py --phases DIR`` (and ``--profile DIR``) links it into a server row's custom_nodes with
``PROMPT_PROFILE_DIR`` and ``PROMPT_PROFILE_NAME`` in the server's environment. ComfyUI runs each prompt in
its prompt worker thread (``execution.PromptExecutor.execute``). For every prompt this pack writes one line
of ``DIR/NAME.phases.jsonl``: the seconds of each node (``execution.execute``), of each model load and
unload through ComfyUI's model management (``load_models_gpu``, ``LoadedModel.model_unload``, with the
model's class), and of each PixArt transformer forward (diffusers' ``PixArtTransformer2DModel.forward``,
which both the Quanto PixArt Sampler and the int8 MODEL's forward run): its host seconds (call to return)
and, on CUDA, its GPU seconds and the GPU's idle time before it (CUDA events, read once the prompt has
ended). What it adds to a prompt is a clock read per call and two events per forward.

With ``PROMPT_PROFILE_TABLES=1`` (``--profile``) the prompt with index :data:`PYTHON_PROMPT` also runs under
cProfile (the worker thread's Python calls, ``NAME.python.txt``) and the next under torch's profiler (CPU and
CUDA, ``NAME.torch.txt``); those two prompts run much slower, so a profiled run's figures are not ones to
compare."""

from __future__ import annotations

import cProfile
import functools
import io
import json
import os
import pstats
import time
from pathlib import Path

NODE_CLASS_MAPPINGS: dict = {}
PYTHON_PROMPT = 2  # the third prompt (index 2) under cProfile, the fourth under torch's profiler


class _Prompt:
    """What one prompt's calls recorded: (kind, label, start, end) on the worker's clock, and each forward's
    CUDA events."""

    def __init__(self):
        self.start = time.perf_counter()
        self.spans: list[tuple[str, str, float, float]] = []
        self.events: list[tuple[object, object]] = []

    def summary(self, index: int) -> dict:
        import torch

        out = {"index": index, "seconds": time.perf_counter() - self.start, "spans": []}
        for kind, label, start, end in self.spans:
            out["spans"].append([kind, label, round(start - self.start, 6), round(end - self.start, 6)])
        if self.events:
            torch.cuda.synchronize()
            gpu, idle = [], []
            for i, (begin, end) in enumerate(self.events):
                gpu.append(begin.elapsed_time(end) / 1000)
                if i:
                    idle.append(self.events[i - 1][1].elapsed_time(begin) / 1000)
            out["forward_gpu"], out["gpu_idle_between_forwards"] = gpu, idle
        return out


_current: list[_Prompt | None] = [None]


def _timed(kind: str, function, label=lambda *a, **k: ""):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        prompt = _current[0]
        if prompt is None:
            return function(*args, **kwargs)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            prompt.spans.append((kind, label(*args, **kwargs), start, time.perf_counter()))

    timed.timed = True
    return timed


def _relative(text: str) -> str:
    """cProfile's file names without this machine's folders: a node pack's from custom_nodes/, any other
    relative to its shortest entry of ``sys.path`` (ComfyUI's folder, the site-packages, the standard
    library)."""
    import sys

    import folder_paths

    for folder in folder_paths.get_folder_paths("custom_nodes"):
        for pack in Path(folder).iterdir():
            for path in {str(pack.resolve()), str(pack)}:
                text = text.replace(path + "/", f"custom_nodes/{pack.name}/")
    entries = {entry.rstrip("/") for entry in [*sys.path, os.getcwd()] if entry and os.path.isdir(entry)}
    for entry in sorted(entries, key=len):
        text = text.replace(entry + "/", "")
    return text


def _model_name(models, *_args, **_kwargs) -> str:
    return ",".join(type(getattr(m, "model", m)).__name__ for m in models)


def _unloaded_name(loaded, *_args, **_kwargs) -> str:
    return type(getattr(loaded.model, "model", loaded.model)).__name__


def _wrap() -> None:
    import comfy.model_management as mm
    import execution

    folder, name = os.environ.get("PROMPT_PROFILE_DIR"), os.environ.get("PROMPT_PROFILE_NAME", "server")
    if not folder or getattr(execution.PromptExecutor.execute, "timed", False):
        return
    out = Path(folder)
    tables = os.environ.get("PROMPT_PROFILE_TABLES") == "1"

    mm.load_models_gpu = _timed("load", mm.load_models_gpu, _model_name)
    mm.LoadedModel.model_unload = _timed("unload", mm.LoadedModel.model_unload, _unloaded_name)

    node_execute = execution.execute

    @functools.wraps(node_execute)
    async def timed_node(server, dynprompt, caches, current_item, *args, **kwargs):
        prompt, start = _current[0], time.perf_counter()
        try:
            return await node_execute(server, dynprompt, caches, current_item, *args, **kwargs)
        finally:
            if prompt is not None:
                try:
                    label = dynprompt.get_node(current_item)["class_type"]
                except Exception:  # a node ComfyUI expanded
                    label = str(current_item)
                prompt.spans.append(("node", label, start, time.perf_counter()))

    execution.execute = timed_node

    try:
        import torch
        from diffusers import PixArtTransformer2DModel

        forward = PixArtTransformer2DModel.forward

        @functools.wraps(forward)
        def timed_forward(self, hidden_states, *args, **kwargs):
            prompt = _current[0]
            if prompt is None:
                return forward(self, hidden_states, *args, **kwargs)
            cuda = hidden_states.is_cuda
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            start = time.perf_counter()
            try:
                return forward(self, hidden_states, *args, **kwargs)
            finally:
                prompt.spans.append(("forward", "", start, time.perf_counter()))
                if cuda:
                    end.record()
                    prompt.events.append((begin, end))

        PixArtTransformer2DModel.forward = timed_forward
    except ImportError:
        pass

    execute = execution.PromptExecutor.execute
    count = [0]

    def tables_of(index, run):
        if index == PYTHON_PROMPT:
            profile = cProfile.Profile()
            try:
                return profile.runcall(run)
            finally:
                text = io.StringIO()
                stats = pstats.Stats(profile, stream=text)
                stats.sort_stats("cumulative").print_stats(70)
                stats.sort_stats("tottime").print_stats(50)
                (out / f"{name}.python.txt").write_text(_relative(text.getvalue()))
        if index == PYTHON_PROMPT + 1:
            import torch
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                result = run()
            averages = prof.key_averages()
            (out / f"{name}.torch.txt").write_text(
                averages.table(sort_by="cpu_time_total", row_limit=60)
                + "\n\n"
                + averages.table(
                    sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40
                )
            )
            return result
        return run()

    @functools.wraps(execute)
    def timed_prompt(self, *args, **kwargs):
        index, count[0] = count[0], count[0] + 1
        _current[0] = prompt = _Prompt()
        try:
            run = functools.partial(execute, self, *args, **kwargs)
            return tables_of(index, run) if tables else run()
        finally:
            _current[0] = None
            with (out / f"{name}.phases.jsonl").open("a") as lines:
                lines.write(json.dumps(prompt.summary(index)) + "\n")

    timed_prompt.timed = True
    execution.PromptExecutor.execute = timed_prompt


_wrap()
