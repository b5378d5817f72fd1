"""One Qwen3.5 GatedDeltaNet layer shaped like Qwen3.6-27B's, forward only, bf16, on the GPU.

    python benchmarks/h200/gdn_layer.py fast|fla-only|reference [--shapes 2x4096,1x16384]

The three modes differ only in what transformers can import when it resolves its fast path at
import time: `fla-only` hides causal_conv1d, `reference` hides both. Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

HIDDEN, V_HEADS, K_HEADS, HEAD_DIM = 5120, 48, 16, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["fast", "fla-only", "reference"])
    parser.add_argument("--shapes", default="2x4096,1x16384")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    if args.mode in ("fla-only", "reference"):
        sys.modules["causal_conv1d"] = None  # type: ignore[assignment]  # import now fails, as if absent
    if args.mode == "reference":
        sys.modules["fla"] = None  # type: ignore[assignment]

    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    picked = {}
    for attr, fn in vars(m).items():
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is not None and cells and "implementation" in code.co_freevars:
            free = dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True))
            impl = free["implementation"]
            picked[free.get("func_name", attr)] = f"{impl.__module__}.{impl.__name__}"

    cfg = Qwen3_5TextConfig(hidden_size=HIDDEN, linear_num_value_heads=V_HEADS, linear_num_key_heads=K_HEADS,
                            linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=4,
                            num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = m.Qwen3_5GatedDeltaNet(cfg, 0).to(device=args.device, dtype=torch.bfloat16).eval()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for shape in args.shapes.split(","):
        batch, tokens = (int(x) for x in shape.split("x"))
        x = torch.randn(batch, tokens, HIDDEN, device=args.device, dtype=torch.bfloat16)
        times = []
        with torch.no_grad():
            for i in range(args.warmup + args.repeats):
                sync()
                t0 = time.perf_counter()
                y = layer(x)
                sync()
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1000)
        assert y.shape == x.shape and torch.isfinite(y.float()).all()
        print(json.dumps({"mode": args.mode, "batch": batch, "tokens": tokens, "median_ms": round(
            statistics.median(times), 3), "times_ms": [round(t, 3) for t in times], "implementations": picked,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}),
              flush=True)


if __name__ == "__main__":
    main()
