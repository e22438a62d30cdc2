"""CUDA kernels of ``omni-plugin-backends-cuda`` against their references (needs a CUDA device).

Attention (bf16, 24 heads, head dim 128, packed batches of 2-8 documents of uneven length, 4k-32k tokens):
  * ``triton_varlen`` vs flash-attn's ``flash_attn_varlen_func`` (when installed): goal >= 0.9x its throughput;
  * ``triton_varlen`` vs torch SDPA over the whole packed sequence with a block-diagonal boolean mask (what a
    backend without varlen support must do): goal >= 1.5x its throughput.
Fused ops (bf16 activations, shapes of a 3072-wide DiT at 8k tokens, a 256-channel VAE feature map) vs the eager
references of ``omnicore.ops.reference``: gated residual + LayerNorm + AdaLN modulate goal >= 2x, the others
goal: not slower.

Without CUDA it prints a skip record naming the reason (``make bench`` lists it as skipped) and exits 0.

    python benchmarks/gpu_kernels.py [--case attn] [--reps 10]
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cuda_reason() -> str | None:
    try:
        from omni_backends_cuda.probe import probe
    except ImportError:
        return "omni-plugin-backends-cuda is not installed"
    return probe()


def _lengths(total: int, docs: int) -> list[int]:
    """Uneven document lengths summing to ``total`` (the last ones longer), each a multiple of 16."""
    weights = [i + 1 for i in range(docs)]
    out = [max(16, total * w // sum(weights) // 16 * 16) for w in weights]
    out[-1] += total - sum(out)
    return out


def cases(device: str = "cuda", tiny: bool = False) -> Iterator[object]:
    """The cases; ``tiny`` shrinks every shape (the test suite runs them once on the CPU in Triton's interpreter
    to check the script itself)."""
    import torch
    import torch.nn.functional as F
    from _harness import Case, ratio_at_most
    from omni_backends_cuda import ops
    from omni_backends_cuda.attention import triton_varlen_attention
    from omni_backends_cuda.plugin import flash_attn_available
    from omnicore.attention.metadata import AttentionMetadata
    from omnicore.ops import reference as ref

    sync = torch.cuda.synchronize if device == "cuda" else None
    dev, bf16 = device, torch.bfloat16
    heads, d = (2, 64) if tiny else (24, 128)
    flash = None
    if flash_attn_available() and device == "cuda":
        import flash_attn

        flash = flash_attn.flash_attn_varlen_func

    for total in ((256,) if tiny else (4096, 16384, 32768)):
        for docs in (2, 8):
            lengths = _lengths(total, docs)
            md = AttentionMetadata.from_lengths(lengths)
            q, k, v = (torch.randn(total, heads, d, device=dev, dtype=bf16) for _ in range(3))
            cu = md.cu_seqlens_q_tensor(dev)
            name = f"attn_{docs}docs_{total // 1024}k_h{heads}_d{d}_bf16"
            ours = lambda q=q, k=k, v=v, md=md: triton_varlen_attention(q, k, v, metadata=md)  # noqa: E731
            longest = max(lengths)
            if flash is not None:
                yield Case("gpu_kernels", name, "triton_varlen", "flash_attn_varlen", ours,
                           lambda q=q, k=k, v=v, cu=cu, m=longest: flash(q, k, v, cu, cu, m, m),
                           goal=ratio_at_most(1 / 0.9), reps=10, warmup=3, sync=sync)
            doc = torch.repeat_interleave(torch.arange(docs, device=dev), torch.tensor(lengths, device=dev))
            mask = (doc[:, None] == doc[None, :])[None, None]
            qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
            yield Case("gpu_kernels", name, "triton_varlen", "sdpa_block_mask", ours,
                       lambda qt=qt, kt=kt, vt=vt, mask=mask: F.scaled_dot_product_attention(qt, kt, vt,
                                                                                           attn_mask=mask),
                       goal=ratio_at_most(1 / 1.5), reps=10, warmup=3, sync=sync)
            del mask

    tokens, width = (16, 64) if tiny else (8192, 3072)
    x = torch.randn(2, tokens, width, device=dev, dtype=bf16)
    upd = torch.randn_like(x)
    gate, shift, scale = (torch.randn(2, 1, width, device=dev, dtype=torch.float32) * 0.1 for _ in range(3))
    h32 = x.float()
    yield Case("gpu_kernels", "gated_residual_layernorm_modulate_2x8k_3072", "fused", "eager",
               lambda: ops.gated_residual_norm_modulate(h32, upd, gate, shift, scale, 1e-6),
               lambda: ref.gated_residual_norm_modulate(h32, upd, gate, shift, scale, 1e-6),
               goal=ratio_at_most(0.5), reps=20, warmup=3, sync=sync)
    w = torch.randn(width, device=dev)
    yield Case("gpu_kernels", "rms_norm_2x8k_3072", "fused", "eager", lambda: ops.rms_norm(x, w, 1e-6),
               lambda: ref.rms_norm(x, w, 1e-6), goal=ratio_at_most(1.0), reps=20, warmup=3, sync=sync)
    yield Case("gpu_kernels", "swiglu_2x8k_3072", "fused", "eager", lambda: ops.swiglu(x, upd),
               lambda: ref.swiglu(x, upd), goal=ratio_at_most(1.0), reps=20, warmup=3, sync=sync)
    qh = torch.randn(2, tokens, heads, d, device=dev, dtype=bf16)
    cos, sin = (torch.randn(1, tokens, 1, d, device=dev) for _ in range(2))
    yield Case("gpu_kernels", "rope_rotate_half_2x8k_h24_d128", "fused", "eager",
               lambda: ops.rope_rotate_half(qh, cos, sin), lambda: ref.rope_rotate_half(qh, cos, sin),
               goal=ratio_at_most(1.0), reps=20, warmup=3, sync=sync)
    channels, side = (64, 6) if tiny else (256, 96)
    fmap = torch.randn(1, channels, 4 if not tiny else 2, side, side, device=dev, dtype=bf16)
    gw, gb = torch.randn(channels, device=dev, dtype=bf16), torch.randn(channels, device=dev, dtype=bf16)
    yield Case("gpu_kernels", "group_norm_silu_256ch_4x96x96", "fused", "eager",
               lambda: ops.group_norm_silu(fmap, 32, gw, gb, 1e-6), lambda: ref.group_norm_silu(fmap, 32, gw, gb, 1e-6),
               goal=ratio_at_most(1.0), reps=20, warmup=3, sync=sync)
    fmap_cl = fmap.contiguous(memory_format=torch.channels_last_3d)
    gamma, beta = torch.randn(channels, 1, 1, 1, device=dev), torch.randn(channels, 1, 1, 1, device=dev)
    yield Case("gpu_kernels", "wan_rms_norm_silu_256ch_4x96x96_cl3d", "fused", "eager",
               lambda: ops.rms_norm_silu(fmap_cl, gamma, beta), lambda: ref.rms_norm_silu(fmap_cl, gamma, beta),
               goal=ratio_at_most(1.0), reps=20, warmup=3, sync=sync)
    # per-request LoRA (issue 22): 8 requests with 8 adapters in one batch on a 3072-wide linear, rank 32, bf16; the
    # eager reference is one bmm pair over equal segments (its best case); goal: the kernel >= 3x its throughput
    rows, width, rank = (16, 64, 4) if tiny else (4096, 3072, 32)
    lx = torch.randn(8 * rows, width, device=dev, dtype=bf16)
    la = torch.randn(8, rank, width, device=dev, dtype=bf16) * width ** -0.5
    lb = torch.randn(8, width, rank, device=dev, dtype=bf16) * rank ** -0.5
    ends = torch.arange(1, 9, dtype=torch.int64) * rows
    yield Case("gpu_kernels", f"lora_segment_delta_8x{rows}_{width}_r{rank}", "triton_sgmv", "eager_grouped",
               lambda: ops.lora_segment_delta(lx, la, lb, ends), lambda: ref.lora_segment_delta(lx, la, lb, ends),
               goal=ratio_at_most(1 / 3), reps=20, warmup=3, sync=sync)


if __name__ == "__main__":
    reason = _cuda_reason()
    if reason is not None:
        from _harness import emit, skipped

        emit(skipped("gpu_kernels", f"no CUDA: {reason}"))
        raise SystemExit(0)
    from _harness import main

    raise SystemExit(main(cases))
