"""LingBot DiT: batch CFG as ONE packed forward (B=2, cu_seqlens documents) vs two sequential B=1 forwards.

Arm a = packed [cond ; uncond] forward, arm b = cond forward + uncond forward (what sequential CFG does).
Text lengths differ between cond and uncond, as in real CFG. Prints one JSON object per case; goal ratio <= 0.8
(the GPU goal; on CPU the packed forward should at least not be slower, ratio <= 1.0).
Run: ``python benchmarks/lingbot_batch_cfg.py [--repeats N]`` (CPU by default, ``--device cuda`` if present).

What the model picks from this: ``batch_cfg`` defaults to ``"auto"`` (``omni_lingbot.request_rules.platform_batch_cfg``)
= two sequential passes on CPU, where this benchmark measures packed slower (2026-12-01: 1.17 dense / 1.26 MoE at
the torch default of 2 threads; 1.00 / 1.17 at 1 thread in ``profile_goals.py``, whose profiles show the same GEMM
and attention time in both arms and the packed arm's elementwise ops slower: its [2, 1536, 1536] FFN activations
pass glibc's 32 MiB mmap ceiling, so each is a fresh mapping with page faults), and one packed forward on CUDA/NPU,
which is the point of packing there but is unmeasured (no GPU yet). An explicit ``batch_cfg`` true/false in a
request is kept on every platform.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from omni_lingbot.transformer.config import LingBotTransformerConfig
from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel

MID = dict(patch_size=[1, 2, 2], in_channels=16, out_channels=16, hidden_size=512, num_attention_heads=8, depth=4,
           intermediate_size=1536, text_dim=256, freq_dim=256, axes_dims=[16, 24, 24], axes_lens=[1024, 256, 256])
MID_MOE = dict(MID, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, n_shared_experts=1, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, mlp_only_layers=[0])

# (case name, config, latent (F, H, W), cond text length, uncond text length)
CASES = [
    ("dense_h512_d4_2x1536video", MID, (4, 32, 48), 160, 96),
    ("moe_h512_d4_2x1536video", MID_MOE, (4, 32, 48), 160, 96),
    ("dense_h512_d4_2x192video", MID, (2, 16, 24), 64, 32),
]


def _interleaved_medians(
    fa: Callable[[], object], fb: Callable[[], object], repeats: int, sync: Callable[[], None]
) -> tuple[float, float]:
    """Median seconds of each arm, alternating a/b every repeat so load drift hits both arms alike."""
    for fn in (fa, fb):  # warm-up
        fn()
        sync()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(repeats):
        for fn, acc in ((fa, ta), (fb, tb)):
            start = time.perf_counter()
            fn()
            sync()
            acc.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


@torch.inference_mode()
def run_case(name: str, raw: dict, latent: tuple[int, int, int], l_cond: int, l_uncond: int, repeats: int,
             device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    cfg = LingBotTransformerConfig.from_dict(raw)
    model = LingBotVideoTransformer3DModel(cfg).to(device).cast(dtype).eval()
    f, h, w = latent
    x = torch.randn(1, cfg.in_channels, f, h, w, device=device)
    t = torch.tensor([700.0], device=device)
    cond = torch.randn(1, l_cond, cfg.text_dim, device=device)
    uncond = torch.randn(1, l_uncond, cfg.text_dim, device=device)
    # batch CFG input: both texts padded to the longer one, real lengths in the mask
    text = torch.zeros(2, l_cond, cfg.text_dim, device=device)
    text[0], text[1, :l_uncond] = cond[0], uncond[0]
    mask = torch.zeros(2, l_cond, dtype=torch.bool, device=device)
    mask[0], mask[1, :l_uncond] = True, True
    x2, t2 = x.expand(2, -1, -1, -1, -1).contiguous(), t.expand(2).contiguous()

    def packed():
        return model(x2, t2, text, mask)

    def sequential():
        return model(x, t, cond), model(x, t, uncond)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # the two arms compute the same thing
    a_out, (c_out, u_out) = packed(), sequential()
    err = max((a_out[0] - c_out[0]).abs().max().item(), (a_out[1] - u_out[0]).abs().max().item())
    a, b = _interleaved_medians(packed, sequential, repeats, sync)
    n_video = (f // cfg.patch_size[0]) * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2])
    return {
        "benchmark": "lingbot_batch_cfg",
        "case": name,
        "arm_a": "packed_b2_forward",
        "arm_b": "two_sequential_b1_forwards",
        "a_median_s": round(a, 5),
        "b_median_s": round(b, 5),
        "ratio": round(a / b, 4),
        "goal": "ratio <= 0.8",
        "met": a / b <= 0.8,
        "video_tokens": n_video,
        "text_tokens": [l_cond, l_uncond],
        "max_abs_diff": err,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--case", action="append", help="run only these case names")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    for name, raw, latent, l_cond, l_uncond in CASES:
        if args.case and name not in args.case:
            continue
        print(json.dumps(run_case(name, raw, latent, l_cond, l_uncond, args.repeats, device, dtype)), flush=True)


if __name__ == "__main__":
    main()
