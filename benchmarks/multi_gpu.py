"""T5-XXL over several GPUs: transformers' ``device_map="balanced"`` spreads the quantized encoder's layers
over every visible GPU; this measures each GPU's peak and resident memory, the time, and the embeddings'
cosine against the same encoder on one GPU (loaded the way the pack loads it: text_encoder.py's model class
and quantization settings, bf16 compute).

    python benchmarks/multi_gpu.py --model-dir DIR --out DIR [--quantization nf4]

Needs two or more GPUs. Writes multi_gpu.json and multi_gpu.md to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

PROMPT = "a photo of a red cat sitting in a sunlit garden, detailed fur"
GIB = 2**30


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


def run(folder: Path, quantization: str, placement: str) -> dict:
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quantization", default="nf4")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print(
            f"multi_gpu: {torch.cuda.device_count()} GPU(s) visible; this needs two or more", file=sys.stderr
        )
        return 2
    run(args.model_dir, args.quantization, "one GPU")  # warm-up: CUDA contexts, kernels, file cache
    rows = [run(args.model_dir, args.quantization, p) for p in ("one GPU", "balanced")]
    reference = rows[0]["embeds"].flatten().double()
    for row in rows:
        out = row.pop("embeds").flatten().double()
        row["cosine_vs_one_gpu"] = float(torch.nn.functional.cosine_similarity(out, reference, dim=0))
    meta = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "quantization": args.quantization,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multi_gpu.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    lines = [
        f"{len(meta['gpus'])} × {meta['gpus'][0]}, {meta['date']}, torch {meta['torch']}; T5-XXL "
        f"{args.quantization} (every linear quantized), bf16 compute, one 300-token prompt. GiB = 2^30 bytes.",
        "",
        "| placement | peak per GPU | resident per GPU | modules per device | load s | total s | cosine |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        peaks = " / ".join(f"{p:.2f}" for p in r["peak_gib"])
        resident = " / ".join(f"{p:.2f}" for p in r["resident_gib"])
        modules = ", ".join(f"{k}: {v}" for k, v in sorted(r["modules_per_device"].items()))
        lines.append(
            f"| {r['placement']} | {peaks} | {resident} | {modules} | {r['load_s']:.2f} | {r['total_s']:.2f} "
            f"| {r['cosine_vs_one_gpu']:.6f} |"
        )
    (args.out / "multi_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
