"""T5-XXL over several GPUs: transformers' ``device_map="balanced"`` spreads the quantized encoder's layers
over every visible GPU; this measures each GPU's peak and resident memory, the time, and the embeddings'
cosine against the same encoder on one GPU (loaded the way the pack loads it: text_encoder.py's model class
and quantization settings, bf16 compute).

    python benchmarks/multi_gpu.py --model-dir pixart-full [--quantization nf4]

Needs two or more GPUs. Writes multi_gpu.json and multi_gpu.md to --out (benchmarks/results).
"""

from __future__ import annotations

import gc
import sys
import time
from collections import Counter
from pathlib import Path

import harness
import torch

PROMPT = harness.PROMPT
GIB = harness.GIB
TITLE = "T5-XXL over several GPUs"


def load(folder: Path, quantization: str, device_map):
    from pixart_lowvram.core import text_encoder
    from pixart_lowvram.core.quant import TEXT_ENCODER_SCHEMES, choose

    scheme = choose(quantization, TEXT_ENCODER_SCHEMES, torch.device("cuda:0"))
    model = text_encoder.t5_class(scheme).from_pretrained(
        folder / "text_encoder",
        dtype=torch.bfloat16,
        device_map=device_map,
        use_safetensors=True,
        **scheme.load_kwargs(torch.bfloat16),
    )
    return scheme.after_load(model).eval()


def encode(folder: Path, quantization: str, placement: str) -> dict:
    from transformers import AutoTokenizer

    gpus = range(torch.cuda.device_count())
    for i in gpus:
        torch.empty(0, device=f"cuda:{i}")  # the device's allocator exists once something was allocated
        torch.cuda.reset_peak_memory_stats(i)
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    tokens = tokenizer(PROMPT, max_length=300, padding="max_length", truncation=True, return_tensors="pt")
    start = time.perf_counter()
    model = load(folder, quantization, {"": "cuda:0"} if placement == "one GPU" else placement)
    loaded = time.perf_counter() - start
    first = next(model.parameters()).device
    with torch.inference_mode():
        embeds = model(
            input_ids=tokens.input_ids.to(first), attention_mask=tokens.attention_mask.to(first)
        ).last_hidden_state
    for i in gpus:
        torch.cuda.synchronize(i)
    result = {
        "placement": placement,
        "load_s": loaded,
        "total_s": time.perf_counter() - start,
        "peak_gib": [torch.cuda.max_memory_allocated(i) / GIB for i in gpus],
        "resident_gib": [torch.cuda.memory_allocated(i) / GIB for i in gpus],
        "modules_per_device": dict(Counter(str(d) for d in getattr(model, "hf_device_map", {}).values())),
        "embeds": embeds.float().cpu(),
    }
    del model, embeds
    gc.collect()
    torch.cuda.empty_cache()
    return result


def markdown(result: dict) -> str:
    cells = []
    for r in result["rows"]:
        cells.append(
            [
                r["placement"],
                " / ".join(f"{p:.2f}" for p in r["peak_gib"]),
                " / ".join(f"{p:.2f}" for p in r["resident_gib"]),
                ", ".join(f"{k}: {v}" for k, v in sorted(r["modules_per_device"].items())),
                f"{r['load_s']:.2f}",
                f"{r['total_s']:.2f}",
                f"{r['cosine_vs_one_gpu']:.6f}",
            ]
        )
    header = ["placement", "peak per GPU", "resident per GPU", "modules per device", "load s", "total s"]
    lines = [
        f"T5-XXL {result['quantization']} (every linear quantized), bf16 compute, one 300-token prompt. "
        "GiB = 2^30 bytes; cosine: the embeddings against one GPU's.",
        "",
        *harness.table([*header, "cosine"], cells),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "multi_gpu")
    p.add_argument("--quantization", default="nf4")
    args = harness.parse(p, argv, title=TITLE, render=markdown, required=("model_dir",))
    if torch.cuda.device_count() < 2:
        print(
            f"multi_gpu: {torch.cuda.device_count()} GPU(s) visible; this needs two or more", file=sys.stderr
        )
        return 2
    run = harness.run(p, args)
    encode(args.model_dir, args.quantization, "one GPU")  # warm-up: CUDA contexts, kernels, file cache
    rows = [encode(args.model_dir, args.quantization, where) for where in ("one GPU", "balanced")]
    reference = rows[0]["embeds"].flatten().double()
    for row in rows:
        out = row.pop("embeds").flatten().double()
        row["cosine_vs_one_gpu"] = float(torch.nn.functional.cosine_similarity(out, reference, dim=0))
    data = {"quantization": args.quantization, "rows": rows}
    result = harness.write(args, data, run=run, title=TITLE, render=markdown)
    print(harness.markdown_text(TITLE, result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
