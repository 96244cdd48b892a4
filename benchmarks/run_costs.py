"""What a later KSampler prompt on the pack's int8 MODEL spends around its forwards, per run: ComfyUI's
loading (``load_models_gpu``), the MODEL's run start (``ON_PRE_RUN``: the weights held expanded, LoRA
patches added) and its end, with and without a LoRA; and what taking the MODEL off the GPU between prompts
costs (its unload, and the load that brings it back). In one process with ComfyUI as a library (the
full-size architecture with random weights, 1024², 20 steps, cfg 4.5, dpmpp_2m/normal as KSampler runs
it), each phase timed with the device synchronized at its edges.

    python benchmarks/run_costs.py --comfyui ComfyUI --model-dir pixart-full [--dynamic-vram]

On a CPU machine ``--preset tiny --size 272 --steps 2 --out DIR`` checks the script. Writes run_costs.json
and run_costs.md to --out (benchmarks/results), and to benchmarks/traces/run_costs/ profile.txt (cProfile of
one run start with the LoRA, by cumulative time) and, on a GPU, load_profile.txt (one unload and load under
torch's profiler and cProfile).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import time

import harness
import torch
from model_lora import arguments, comfy_modules, ksample, ksampler_settings, random_embeds

TITLE = "Around a KSampler prompt's forwards on the int8 MODEL"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Phases:
    """Seconds spent in a few functions, summed per prompt (the device synchronized at each edge)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def timed(self, name, function):
        def call(*args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                sync()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return call

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


def markdown(result: dict) -> str:
    """The later prompts' means per configuration (ms), and the MODEL's moves off the GPU and back."""
    phases = ["seconds", "load_models_gpu", "run start (ON_PRE_RUN)", "run end (ON_CLEANUP)"]
    cells = [
        [row["name"]] + [f"{1000 * row['later'].get(phase, 0.0):.1f}" for phase in phases]
        for row in result["rows"]
    ]
    lines = [
        f"{result['patcher']} (Dynamic VRAM {'on' if result['dynamic_vram'] else 'off'}), "
        f"{result['arguments'].get('size')}², {result['arguments'].get('steps')} steps, cfg 4.5, "
        f"dpmpp_2m/normal, a rank-{result['arguments'].get('rank')} LoRA at strength 1; the later prompts' "
        "means in ms, each phase timed with the device synchronized at its edges.",
        "",
        *harness.table(["MODEL", "prompt", *phases[1:]], cells),
        "",
        "The MODEL taken off the GPU and brought back (ComfyUI's unload_all_models, then load_models_gpu), ms:",
        "",
    ]
    moves = [
        [
            "page-locked host copies" if move.get("homes") else "as ComfyUI moves a plain MODEL",
            "kept" if move.get("cache kept") else "emptied",
            f"{1000 * move['unload']:.1f}",
            f"{1000 * move['load']:.1f}",
        ]
        for move in result["moves"]
    ]
    lines += harness.table(["where the weights wait", "allocator cache", "unload", "load"], moves)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "run_costs", prompts=4)
    args = harness.parse(parser, argv, title=TITLE, render=markdown, required=("comfyui", "model_dir"))
    measured = harness.run(parser, args, args.comfyui)

    comfy, int8_model = comfy_modules(args.comfyui, args.dynamic_vram)
    import comfy.model_management as mm

    device, lora_path, settings = ksampler_settings(args)
    phases = Phases()
    run_class = int8_model.lora.RunPatches
    run_class.start = phases.timed("run start (ON_PRE_RUN)", run_class.start)
    run_class.end = phases.timed("run end (ON_CLEANUP)", run_class.end)
    # comfy.sampler_helpers.prepare_sampling looks it up on the module at each call.
    mm.load_models_gpu = phases.timed("load_models_gpu", mm.load_models_gpu)

    lora_state = comfy.utils.load_torch_file(str(lora_path), safe_load=True)
    model = int8_model.load(settings.transformer, keep_loaded=True)
    with_lora, _ = comfy.sd.load_lora_for_models(model, None, lora_state, 1.0, 0)
    released = int8_model.load(settings.transformer, settings.keep_loaded)
    released_lora, _ = comfy.sd.load_lora_for_models(released, None, lora_state, 1.0, 0)
    embeds = [random_embeds(i, settings.caption_channels) for i in range(args.prompts)]
    latent = torch.zeros(1, 4, args.size // 8, args.size // 8)
    rows = []
    configs = (
        ("MODEL, keep_loaded", model),
        ("MODEL + LoRA, keep_loaded", with_lora),
        ("MODEL, keep_loaded off", released),
        ("MODEL + LoRA, keep_loaded off", released_lora),
    )
    for name, patcher in configs:
        prompts = []
        for i in range(args.prompts):
            phases.take()
            sync()
            start = time.perf_counter()
            ksample(comfy, patcher, 1000 + i, embeds[i], latent, args.steps, 4.5)
            sync()
            prompts.append({"seconds": time.perf_counter() - start, **phases.take()})
        later = prompts[1:]
        mean = {key: sum(p.get(key, 0.0) for p in later) / len(later) for key in prompts[-1]}
        rows.append({"name": name, "prompts": prompts, "later": mean})
        print(name, json.dumps({k: round(v, 4) for k, v in mean.items()}), flush=True)

    # One run start with the LoRA under cProfile (the weights held expanded and patched), then its end.
    profile = cProfile.Profile()
    run = int8_model.lora.RunPatches(settings.transformer)
    mm.load_models_gpu([with_lora])
    profile.enable()
    run.start(with_lora)
    sync()
    profile.disable()
    run.end(with_lora)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)

    # The MODEL taken off the GPU and brought back, as ComfyUI does it: from its layers' page-locked homes,
    # and as ComfyUI moves a plain MODEL (without homes: to fresh pageable memory and back).
    moves = []

    def moved(**tags) -> None:
        """The MODEL unloaded and loaded back, three times, each timed with the device synchronized."""
        for _ in range(3):
            sync()
            start = time.perf_counter()
            mm.unload_all_models()
            sync()
            unloaded = time.perf_counter() - start
            phases.take()
            mm.load_models_gpu([with_lora])
            moves.append({**tags, "unload": unloaded, "load": phases.take().get("load_models_gpu", 0.0)})

    homed = int8_model.residence.HostCopies.COPIED
    for homes in (True, False, True):
        int8_model.residence.HostCopies.COPIED = homed if homes else ()
        moved(homes=homes)
    int8_model.residence.HostCopies.COPIED = homed
    # The same with the allocator's cache kept (ComfyUI's empty_cache after an unload skipped): what the
    # device allocations cost of the load.
    empty_cache = torch.cuda.empty_cache
    torch.cuda.empty_cache = lambda: None
    try:
        moved(homes=True, **{"cache kept": True})
    finally:
        torch.cuda.empty_cache = empty_cache
    print("moves", json.dumps(moves), flush=True)
    # One unload and load under torch's profiler: the host's calls into CUDA (allocations, copies,
    # synchronizations) by their own time, and Python's by its.
    load_profile = ""
    if device == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        python_profile = cProfile.Profile()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as traced:
            mm.unload_all_models()
            python_profile.enable()
            mm.load_models_gpu([with_lora])
            sync()
            python_profile.disable()
        load_profile = traced.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        listing = io.StringIO()
        pstats.Stats(python_profile, stream=listing).sort_stats("tottime").print_stats(25)
        load_profile += "\n\nload_models_gpu under cProfile, by own time\n" + listing.getvalue()

    data = {"patcher": type(model).__name__, "dynamic_vram": args.dynamic_vram, "rows": rows, "moves": moves}
    result = harness.write(args, data, run=measured, title=TITLE, render=markdown)
    traces = harness.traces("run_costs")
    (traces / "profile.txt").write_text(text.getvalue())
    if load_profile:
        (traces / "load_profile.txt").write_text(load_profile)
    print(harness.markdown_text(TITLE, result, markdown))


if __name__ == "__main__":
    main()
