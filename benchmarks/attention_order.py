"""Which attention kernel a process's first scaled-dot-product-attention call takes, and its later ones:
PixArt-Σ's self-attention shapes at 1024² (q, k, v (2, 16, 4096, 72) fp16, laid out as ComfyUI's PixArt
makes them from one qkv projection), each way in a fresh process, every call's output compared bit for bit
with each backend's own (``sdpa_kernel([backend])``, computed after the calls under test) and the backend
priority order read before and after each call.

Ways (``--only``, repeatable; all by default):

- ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` with torch's own settings;
- ``comfyui``: ComfyUI's ``comfy.ops.scaled_dot_product_attention`` (``--comfyui``: the checkout), what
  ComfyUI's PixArt calls through ``optimized_attention``;
- ``comfyui, warmed``: the same after one call of it on other data, as a MODEL's load could make.

On the GPU machine::

    python benchmarks/attention_order.py --comfyui ComfyUI --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

WAYS = ("torch", "comfyui", "comfyui, warmed")
CALLS = 4


def probe(way: str, comfyui: str | None) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if way.startswith("comfyui"):
        sys.path.insert(0, comfyui)
        import comfy.ops

        function = comfy.ops.scaled_dot_product_attention
    else:
        function = torch.nn.functional.scaled_dot_product_attention
    generator = torch.Generator(device="cuda").manual_seed(0)

    def qkv():
        # (batch, tokens, q/k/v, heads, head dim) permuted to (batch, heads, tokens, head dim), as PixArt's
        # attention reshapes its one projection: strides (14155776, 72, 3456, 1).
        t = torch.randn(2, 4096, 3, 16, 72, device="cuda", dtype=torch.float16, generator=generator)
        return [t[:, :, i].permute(0, 2, 1, 3) for i in range(3)]

    if way.endswith("warmed"):
        function(*qkv())
    q, k, v = qkv()
    calls = []
    for _ in range(CALLS):
        before = [int(b) for b in torch._C._get_sdp_priority_order()]
        out = function(q, k, v)
        torch.cuda.synchronize()
        calls.append(
            {
                "out": out,
                "priority_before": before,
                "priority_after": [int(b) for b in torch._C._get_sdp_priority_order()],
            }
        )
    references = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                references[backend.name] = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        except RuntimeError as error:
            references[backend.name] = str(error).splitlines()[0]
    rows = []
    for index, call in enumerate(calls):
        rows.append(
            {
                "call": index + 1,
                "equals": [
                    n
                    for n, r in references.items()
                    if isinstance(r, torch.Tensor) and torch.equal(r, call["out"])
                ],
                "equals_first_call": bool(torch.equal(call["out"], calls[0]["out"])),
                "priority_before": call["priority_before"],
                "priority_after": call["priority_after"],
            }
        )
    return {
        "way": way,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(),
        "backend_numbers": {
            b.name: int(b)
            for b in (
                SDPBackend.MATH,
                SDPBackend.FLASH_ATTENTION,
                SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION,
            )
        },
        "calls": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"))
    parser.add_argument("--out", type=Path, default=Path("attention_order"))
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(probe(args.one, args.comfyui)))
        return
    results = []
    for way in args.only or WAYS:
        done = subprocess.run(
            [sys.executable, __file__, "--one", way] + (["--comfyui", args.comfyui] if args.comfyui else []),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            results.append({"way": way, "error": done.stderr[-2000:]})
            print(f"{way}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(result)
        for call in result["calls"]:
            print(
                f"{way}: call {call['call']}: equals {call['equals'] or 'no backend alone'}, same as call 1: "
                f"{call['equals_first_call']}, priority {call['priority_before']} -> {call['priority_after']}",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_order.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
