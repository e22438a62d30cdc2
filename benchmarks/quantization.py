"""Weight-only int8 / fp8 vs unquantized: resident DiT bytes and one DiT forward's time.

A LingBot DiT (the tiny preset's shape and a mid-size one: hidden 1024, 8 blocks, FFN 3072) is built with random
weights in the compute dtype (bf16 on CUDA, fp32 on CPU, where bf16 matmuls are slow and would flatter the
dequantizing arm), then quantized with :func:`omnicore.quantization.quantize_module` over the linears its plugin
declares (``QUANTIZABLE["transformer"]``). Cases (one JSON line each):

- ``resident_<mode>_<size>``: resident DiT bytes quantized / unquantized (``static_case``). Goal ratio <= 0.55
  against bf16 (the issue's goal); on CPU the reference is fp32, so the printed ``bf16_ratio`` recomputes it
  against the bf16 size of the same modules (the 1-byte weights are the same either way).
- ``step_<mode>_<size>``: one DiT forward (video 2 x 16 x 16 latent, 64 text tokens), quantized vs not. The GPU
  goal (FP8 step <= 0.7x bf16 at H3 size with ``torch._scaled_mm``) needs an FP8 GPU and is unverified here; on
  CPU weight-only quantization dequantizes each weight per call, so it is *slower*: the goal recorded for CPU is
  only that it stays within 3x.

Run: ``python benchmarks/quantization.py [--reps 5] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, main, ratio_at_most, static_case

BENCH = "quantization"
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "num_attention_heads": 2, "depth": 2, "intermediate_size": 128, "text_dim": 32,
             "freq_dim": 32, "axes_dims": [8, 12, 12], "axes_lens": [64, 64, 64], "in_channels": 4,
             "out_channels": 4},
    "mid": {"hidden_size": 1024, "num_attention_heads": 8, "depth": 8, "intermediate_size": 3072, "text_dim": 1024,
            "freq_dim": 256, "axes_dims": [32, 48, 48], "in_channels": 16, "out_channels": 16},
}


def build(size: str, dtype: torch.dtype, device: str) -> Any:
    from omni_lingbot.loader import cast_for_inference
    from omni_lingbot.transformer.config import LingBotTransformerConfig
    from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel

    torch.manual_seed(0)
    model = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(SIZES[size]))
    return cast_for_inference(model, dtype).to(device).eval().requires_grad_(False)


def inputs(size: str, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    cfg = SIZES[size]
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(1, cfg["in_channels"], 2, 16, 16, generator=g).to(device, dtype)
    text = torch.randn(1, 64, cfg["text_dim"], generator=g).to(device, dtype)
    return lat, torch.tensor([500.0], device=device), text


def cases(reps: int) -> Any:
    from omni_lingbot.presets import QUANTIZABLE
    from omnicore.quantization import quantize_module, resident_bytes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else None
    for size in SIZES:
        base = build(size, dtype, device)
        base_bytes = resident_bytes(base)
        bf16_bytes = resident_bytes(build(size, torch.bfloat16, "cpu")) if dtype != torch.bfloat16 else base_bytes
        x = inputs(size, dtype, device)
        for mode in ("int8", "fp8"):
            quant = build(size, dtype, device)
            report = quantize_module(quant, mode, QUANTIZABLE["transformer"])
            q_bytes = resident_bytes(quant)
            quant_bf16 = build(size, torch.bfloat16, "cpu")
            quantize_module(quant_bf16, mode, QUANTIZABLE["transformer"])
            yield static_case(BENCH, f"resident_{mode}_{size}", mode, str(dtype).replace("torch.", ""), {
                "a_value": q_bytes, "b_value": base_bytes, "bf16_ratio": resident_bytes(quant_bf16) / bf16_bytes,
                "backend": report.linear_backend, "linears": len(report.linears), "device": device,
            }, ratio_at_most(0.55, metric="bf16_ratio"))
            with torch.no_grad():
                ref, out = base(*x).float(), quant(*x).float()
            rel = float((out - ref).norm() / ref.norm())

            def run(m: Any = quant, args: tuple[torch.Tensor, ...] = x) -> Any:
                with torch.no_grad():
                    return m(*args)

            def run_base(m: Any = base, args: tuple[torch.Tensor, ...] = x) -> Any:
                with torch.no_grad():
                    return m(*args)

            goal = ratio_at_most(0.7 if device == "cuda" else 3.0)
            yield Case(BENCH, f"step_{mode}_{size}", mode, str(dtype).replace("torch.", ""), run, run_base, goal,
                       reps=reps, warmup=1, sync=sync,
                       extra={"rel_err": rel, "backend": report.linear_backend, "device": device})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args, rest = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    raise SystemExit(main(lambda: cases(args.reps), rest))
