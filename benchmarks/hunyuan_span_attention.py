"""HunyuanImage-3 attention with span metadata vs the dense-mask reference at 4k tokens.

The layout is an edit request's: 600 text tokens, a 1000-token joint condition image, 50 text tokens, a
2400-token generated image and 46 trailing tokens (4096 in all); attention is causal plus bidirectional inside
both images. Arms, one CFG row, 8 query heads of 64 with 2 K/V heads:

- ``span_metadata``: the model's path with no engine backend (:func:`omni_hunyuan.transformer.attention.span_attention`, which
  calls omnicore's reference ``sdpa`` with span metadata: one SDPA per run of queries sharing a key prefix, no
  mask except a few rows for the short text runs between spans);
- ``core_sdpa_metadata``: the same backend handed to the model's ``SpanAttention`` (what the engine selects on
  CPU);
- ``dense_mask``: the O(S²) reference, the ``[S, S]`` boolean mask built and passed to one SDPA call.

Time: interleaved medians (harness). Peak memory: each arm runs in a fresh interpreter (Linux): after one
warm-up call the peak-RSS mark is reset, and the record holds how far the peak rose above the resident size
during one call, in MiB.

Goals: time ``ratio <= 1.0`` and peak-memory ``ratio <= 0.5`` against the dense mask.
Run: ``python benchmarks/hunyuan_span_attention.py [--reps N] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, main, ratio_at_most, static_case

SEQ = 4096
SPANS = ((600, 1600), (1650, 4050))
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, SEQ, HEADS, HEAD_DIM, generator=g), torch.randn(1, SEQ, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(1, SEQ, KV_HEADS, HEAD_DIM, generator=g))


def arm(name: str) -> Any:
    from omni_hunyuan.transformer.attention import SpanAttention, dense_mask_attention, span_attention

    if name == "span_metadata":
        return lambda q, k, v: span_attention(q, k, v, SPANS)
    if name == "core_sdpa_metadata":
        from omnicore.attention.reference import sdpa_attention

        attend = SpanAttention(sdpa_attention)
        if attend.backend is None:
            raise RuntimeError("this omnicore has no AttentionMetadata spans")
        return lambda q, k, v: attend(q, k, v, SPANS)
    return lambda q, k, v: dense_mask_attention(q, k, v, SPANS)


def measure_peak(name: str, threads: int) -> float:
    """MiB the process's peak RSS rises during one call of ``name`` (fresh interpreter)."""
    out = subprocess.run([sys.executable, __file__, "--peak-of", name, "--threads", str(threads)], check=True,
                         capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(name: str, threads: int) -> None:
    """Warm the arm once, reset the peak-RSS mark (``/proc/self/clear_refs`` 5), then measure one call."""
    torch.set_num_threads(threads)
    q, k, v = inputs()
    fn = arm(name)
    with torch.no_grad():
        fn(q, k, v)
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        fn(q, k, v)
        peak = _status_kib("VmHWM")
    print(json.dumps({"peak_mib": max(0, peak - before) / 1024.0}))


def cases(args: argparse.Namespace) -> Any:
    torch.set_num_threads(args.threads)
    q, k, v = inputs()
    ref = arm("dense_mask")
    extra = {"seq_len": SEQ, "spans": SPANS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
             "threads": torch.get_num_threads()}

    def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
        return {"max_abs_diff": float((a - b).abs().max())}

    dense_peak = measure_peak("dense_mask", args.threads)
    for name in ("span_metadata", "core_sdpa_metadata"):
        fn = arm(name)
        with torch.no_grad():
            yield Case("hunyuan_span_attention", f"{name}_vs_dense_mask_4k_time", name, "dense_mask",
                       lambda fn=fn: fn(q, k, v), lambda: ref(q, k, v), goal=ratio_at_most(1.0), reps=args.reps_default,
                       warmup=1, compare=compare, extra=extra)
        peak = measure_peak(name, args.threads)
        yield static_case("hunyuan_span_attention", f"{name}_vs_dense_mask_4k_peak_memory", name, "dense_mask",
                          {"a_value": peak, "b_value": dense_peak, "unit": "MiB peak RSS rise", **extra},
                          ratio_at_most(0.5))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps-default", type=int, default=9)
    parser.add_argument("--peak-of", default=None)
    known, rest = parser.parse_known_args()
    if known.peak_of:
        _child(known.peak_of, known.threads)
        raise SystemExit(0)
    raise SystemExit(main(lambda: cases(known), rest))
