"""MiniMax-H3 DiT: our serving DiT vs diffusers' ``MiniMaxH3Transformer3DModel`` on identical weights.

The diffusers model is built from a mid-size config with H3's proportions (heads·128 = 4H/3, ffn 8H/3,
time_embed_dim H/2, 2 refiner layers), saved with ``save_pretrained`` and loaded by our loader, so both arms
hold the very same weights (fp32). Layouts come from diffusers' own layout builders. Cases (one JSON line each):

- ``forward_t2va_*``: one denoise-step forward of a t2va request. Ours runs the per-step forward on a plan
  prepared once per request (RoPE table, token-refined text; the prepare time is reported as ``a_prepare_s``);
  diffusers runs its forward (refiner and RoPE inside). ``seq_align`` 1 = no padding rows (what a CPU deployment
  uses), 64 = the ``[real | pad]`` layout of accelerators. Goal ratio <= 0.9 and the outputs agree (fp32).
- ``packed_pair_*``: a t2va and an fl2va request (different timesteps) in ONE packed forward vs diffusers run once
  per request. Goal ratio <= 0.8.
- ``peak_rss_adaln_offload_*``: peak RSS of the DiT over denoise steps (bf16, H3 proportions, 25 blocks + 1 refiner
  block = the release's 50:2) with the exact-schedule AdaLN cache and ``offload_weights=true`` vs the cache without
  offload (``b``) and vs no cache (``no_cache_value``); measured in a child process as VmHWM over two denoise
  steps (reset after the schedule is prepared) minus the RSS before the DiT was built (after a tiny warm-up forward
  initialised the math libraries); the transient peak while
  the tables are built (weights still resident) is ``offload_prepare_peak_bytes``. On a CPU device the projection
  weights are spilled to a file. Goal ratio <= 0.62; ``analytic_ratio*`` are the same ratios from parameter and
  table shapes at this config, ``h3_real_ratio*`` at the real size (H 5376, 50 blocks): at reduced width the
  tables weigh more against the projections (2·steps·unique/time_embed_dim), so the 49-step case sits above the
  real-size ratio; the second case scales the steps (14 at H 1536) to keep the real table/projection proportion.

Run: ``python benchmarks/minimax_h3_dit.py [--reps 7] [--case forward] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, main, ratio_at_most, static_case

BENCH = "minimax_h3_dit"
AGREE = ratio_at_most(1e-4, metric="max_abs_diff")  # same work on both arms: outputs agree (fp32)
PATCH = (1, 2, 2)


def h3_config(hidden: int, layers: int, refiner: int = 2) -> Any:
    from omni_minimax_h3.transformer.config import MiniMaxH3TransformerConfig

    return MiniMaxH3TransformerConfig(
        hidden_size=hidden, num_attention_heads=4 * hidden // 3 // 128, attention_head_dim=128, ffn_dim=8 * hidden // 3,
        num_layers=layers, num_refiner_layers=refiner, text_dim=hidden, time_embed_hidden_dim=hidden,
        time_embed_dim=hidden // 2)


# ---------------------------------------------------------------------------------------------- forward cases
def reference_model(config: Any, seed: int = 0) -> Any:
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**config.to_dict())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.05))
    return model.float().eval()


def layout(num_text: int, frames: int, lh: int, lw: int, audio_latents: int, anchors: tuple[str, ...] = ()) -> dict:
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    tags = torch.ones(num_text, dtype=torch.long)
    if anchors:
        tags[1:1 + num_text // 2] = 0  # a presentation vision block
    out = MiniMaxH3PrepareLayoutStep.build_packed_sequence(tags, frames, lh, lw, audio_latents, PATCH, 2, 2, 0,
                                                           anchors)
    keys = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices",
            "num_condition_video_rows", "num_condition_audio_rows")
    return dict(zip(keys, out))


class Request:
    def __init__(self, raw: dict, config: Any, seed: int, t_video: float, t_audio: float) -> None:
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

        g = torch.Generator().manual_seed(seed)
        self.raw, self.t_video, self.t_audio = raw, t_video, t_audio
        self.video = torch.randn(raw["video_indices"].numel(), config.video_patch_dim, generator=g)
        self.audio = torch.randn(raw["audio_indices"].numel(), config.audio_in_channels, generator=g)
        self.text = torch.randn(raw["text_indices"].numel(), config.text_dim, generator=g)
        self.unique, self.inverse = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            raw["video_indices"], raw["audio_indices"], raw["num_condition_video_rows"],
            raw["num_condition_audio_rows"], raw["text_indices"].numel(), t_video, t_audio, max(t_video, 0.999), 1.0)

    def reference(self, ref: Any) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.raw
        with torch.no_grad():
            v, a = ref(hidden_states=self.video[None], audio_hidden_states=self.audio[None],
                       encoder_hidden_states=self.text[None], timestep=self.unique, timestep_indices=self.inverse,
                       token_tags=r["token_tags"], position_ids=r["position_ids"], video_indices=r["video_indices"],
                       audio_indices=r["audio_indices"], text_indices=r["text_indices"], return_dict=False)
        return v[0], a[0]

    def plan(self, dit: Any, seq_align: int) -> Any:
        from omni_minimax_h3.transformer.layout import RequestLayout

        r = self.raw
        lay = RequestLayout.build(r["position_ids"], r["token_tags"], r["video_indices"], r["audio_indices"],
                                  r["text_indices"], r["num_condition_video_rows"], r["num_condition_audio_rows"],
                                  seq_align=seq_align)
        return dit.prepare_request(lay, self.text)


def ours_step(dit: Any, requests: list[Request], seq_align: int) -> tuple[Any, float]:
    start = time.perf_counter()
    batch = dit.pack([r.plan(dit, seq_align) for r in requests])
    prepare_s = time.perf_counter() - start
    ts = batch.step_timesteps([r.t_video for r in requests], [r.t_audio for r in requests])
    video = torch.cat([r.video for r in requests])
    audio = torch.cat([r.audio for r in requests])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return dit(batch, video, audio, ts.unique_timesteps, ts.inverse_indices)

    return run, prepare_s, batch


def forward_cases(args: argparse.Namespace) -> Any:
    from omni_minimax_h3.loader import load_transformer

    config = h3_config(args.hidden, args.layers)
    ref = reference_model(config)
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        dit = load_transformer(tmp)
    info = {"hidden": config.hidden_size, "layers": config.num_layers, "refiner_layers": config.num_refiner_layers,
            "heads": config.num_attention_heads, "ffn": config.ffn_dim, "dtype": "float32", "threads": args.threads}

    def agree(out_a: Any, out_b: Any) -> dict:
        pairs = list(zip(out_a, out_b)) if isinstance(out_b, list) else [(out_a, out_b)]
        diff = 0.0
        for ours, theirs in pairs:
            for x, y in zip(ours, theirs):
                diff = max(diff, (x - y).abs().max().item())
        return {"max_abs_diff": diff}

    t2va = Request(layout(64, 7, 16, 16, 37), config, 0, 0.3, 0.5)
    for align in (1, 64):
        run, prep, batch = ours_step(dit, [t2va], align)
        yield Case(BENCH, f"forward_t2va_h{args.hidden}_l{args.layers}_seq_align{align}", "ours", "diffusers", run,
                   lambda: t2va.reference(ref), goal=(ratio_at_most(0.9), AGREE), reps=args.reps, warmup=1,
                   compare=agree, extra={**info, "rows_used": t2va.raw["position_ids"].shape[0],
                                         "rows_packed": batch.total, "seq_align": align, "a_prepare_s": prep})

    for label, (frames, lh) in (("mid", (7, 16)), ("small", (7, 8))):
        reqs = [Request(layout(48, frames, lh, lh, 37), config, 1, 0.3, 0.5),
                Request(layout(64, frames, lh, lh, 37, anchors=("first", "last")), config, 2, 0.7, 0.6)]
        run, prep, batch = ours_step(dit, reqs, 1)
        yield Case(BENCH, f"packed_pair_{label}_h{args.hidden}_l{args.layers}", "ours_packed", "diffusers_x2", run,
                   lambda reqs=reqs: [r.reference(ref) for r in reqs], goal=(ratio_at_most(0.8), AGREE),
                   reps=args.reps, warmup=1,
                   compare=lambda a, b, batch=batch: agree(
                       list(zip(batch.split_video(a[0]), batch.split_audio(a[1]))), b),
                   extra={**info, "rows_packed": batch.total, "a_prepare_s": prep})


# ---------------------------------------------------------------------------------------------- peak RSS
def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _random_dit(config: Any, dtype: torch.dtype) -> Any:
    """Our DiT with random weights, materialised straight in ``dtype`` (fp32 islands kept), every page touched."""
    from omni_minimax_h3.transformer.model import MiniMaxH3DiT, is_fp32_kept

    with torch.device("meta"):
        dit = MiniMaxH3DiT(config)
    g = torch.Generator().manual_seed(0)
    for name, p in list(dit.named_parameters()):
        dt = torch.float32 if is_fp32_kept(name) else dtype
        fresh = torch.empty(p.shape, dtype=dt)
        if p.dim() == 1:
            fresh.fill_(1.0 if "norm" in name else 0.0)
        else:
            fresh.normal_(0.0, 0.5 / p.shape[-1] ** 0.5, generator=g)
        owner, _, leaf = name.rpartition(".")
        dit.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(fresh, requires_grad=False)
    dit.rope.reset_parameters()
    return dit.eval().requires_grad_(False)


def rss_child(hidden: int, layers: int, refiner: int, steps: int) -> dict:
    """Runs in a fresh process: DiT-attributable peak RSS for no cache / cache / cache + offload."""
    from omnicore.cache.adaln_schedule import schedule_key

    torch.set_num_threads(1)
    config = h3_config(hidden, layers, refiner)
    req = Request(layout(16, 2, 8, 8, 10), config, 0, 0.3, 0.5)  # ~60 rows: weights dominate, as in serving
    import gc

    from omni_minimax_h3.transformer.config import MiniMaxH3TransformerConfig

    # Initialise the math libraries (GEMM/attention workspaces, thread pools) on a tiny DiT first, so that the
    # baseline holds them and the numbers below are the DiT's own memory.
    tiny = MiniMaxH3TransformerConfig.tiny()
    warm, warm_req = _random_dit(tiny, torch.bfloat16), Request(layout(16, 2, 8, 8, 10), tiny, 0, 0.3, 0.5)
    warm_batch = warm.pack([warm_req.plan(warm, 1)])
    warm_ts = warm_batch.step_timesteps([0.3], [0.5])
    with torch.no_grad():
        warm(warm_batch, warm_req.video, warm_req.audio, warm_ts.unique_timesteps, warm_ts.inverse_indices)
    del warm, warm_req, warm_batch, warm_ts
    gc.collect()
    base = _rss_kib("VmRSS")
    dit = _random_dit(config, torch.bfloat16)
    built = _rss_kib("VmRSS")
    batch = dit.pack([req.plan(dit, 1)])
    sig_v = [12 * b / (1 + 11 * b) for b in torch.linspace(1, 0, steps + 1).tolist()]
    sig_a = [3 * b / (1 + 2 * b) for b in torch.linspace(1, 0, steps + 1).tolist()]
    metas = [batch.step_timesteps([1 - sv], [1 - sa]) for sv, sa in zip(sig_v[:-1], sig_a[:-1])]
    video, audio = req.video, req.audio

    def denoise(cached: bool, n: int = 2) -> None:
        with torch.no_grad():
            for k, m in enumerate(metas[:n]):
                kw = {"adaln_step_index": k} if cached else {}
                dit(batch, video, audio, m.unique_timesteps, m.inverse_indices, **kw)

    def peak(cached: bool) -> int:
        gc.collect()
        _reset_peak()
        denoise(cached)
        return (_rss_kib("VmHWM") - base) * 1024

    out = {"weights_bytes": sum(p.numel() * p.element_size() for p in dit.parameters()),
           "rss_after_build_bytes": (built - base) * 1024}
    denoise(False, 1)  # warm-up allocations
    out["no_cache"] = peak(False)
    plan, key = [m.unique_timesteps for m in metas], schedule_key(metas)
    cache = dit.adaln.prepare(plan, key)
    out["cache"] = peak(True)
    out["table_bytes"] = cache.table_bytes
    dit.adaln.clear()
    gc.collect()
    _reset_peak()
    cache = dit.adaln.prepare(plan, key, offload_weights=True)
    out["offload_prepare_peak"] = (_rss_kib("VmHWM") - base) * 1024  # weights + tables, before the spill
    if cache is None:
        raise RuntimeError("tables are not smaller than the projection weights at this size")
    out["offload"] = peak(True)
    out["offloaded_projection_bytes"] = cache.offloaded_projection_bytes
    dit.adaln.clear()
    return out


def analytic(hidden: int, layers: int, refiner: int, steps: int, unique: int = 2) -> tuple[float, float]:
    """(offload / cache, offload / no cache) parameter+table bytes from shapes (the real H3 when called with it)."""
    h, i, f, te, td = hidden, 4 * hidden // 3, 8 * hidden // 3, hidden // 2, int(0.95 * hidden)
    dense = h * 3 * i + i * h + h * 2 * f + f * h + 2 * h + 256
    adaln, tables = te * 18 * h + 18 * h, steps * unique * 3 * 6 * h
    final_adaln, final_tables = te * 2 * h + 2 * h, steps * unique * 2 * h
    other = 96 * h + 32 * h + td * h + 256 * h + h * te + h * 128 + 6 * h
    no_cache = layers * (dense + adaln) + refiner * dense + final_adaln + other
    cache = no_cache + layers * tables + final_tables
    offload = cache - layers * adaln - final_adaln
    return offload / cache, offload / no_cache


def rss_cases(args: argparse.Namespace) -> Any:
    # 49 steps = the default schedule; the second case scales the step count with time_embed_dim so that the tables
    # weigh against the projections as the real model's 49-step tables do (steps·unique/time_embed_dim = 98/2688).
    matched = max(1, round(49 * (args.rss_hidden // 2) / 2688))
    for steps, label in ((49, "default_schedule_49_steps"), (matched, f"{matched}_steps_real_table_proportion")):
        cmd = [sys.executable, __file__, "--rss-child", str(args.rss_hidden), str(args.rss_layers), "1", str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"rss child failed: {proc.stderr[-2000:]}")
        m = json.loads(proc.stdout.strip().splitlines()[-1])
        real_vs_cache, real_vs_none = analytic(5376, 50, 2, steps)
        here_vs_cache, here_vs_none = analytic(args.rss_hidden, args.rss_layers, 1, steps)
        yield static_case(BENCH, f"peak_rss_adaln_offload_h{args.rss_hidden}_l{args.rss_layers}_{label}",
                          "cache_offload_weights", "cache_weights_resident", {
                              "a_value": m["offload"], "b_value": m["cache"], "no_cache_value": m["no_cache"],
                              "ratio_vs_no_cache": m["offload"] / m["no_cache"],
                              "table_bytes": m["table_bytes"],
                              "offloaded_projection_bytes": m["offloaded_projection_bytes"],
                              "weights_bytes": m["weights_bytes"], "offload_prepare_peak_bytes": m["offload_prepare_peak"],
                              "analytic_ratio_this_config": here_vs_cache,
                              "analytic_ratio_vs_no_cache_this_config": here_vs_none,
                              "h3_real_ratio": real_vs_cache, "h3_real_ratio_vs_no_cache": real_vs_none,
                              "steps": steps, "hidden": args.rss_hidden, "layers": args.rss_layers,
                              "refiner_layers": 1, "dtype": "bfloat16",
                          }, ratio_at_most(0.62))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rss-child":
        h, layers, refiner, steps = (int(v) for v in sys.argv[2:6])
        print(json.dumps(rss_child(h, layers, refiner, steps)))
        raise SystemExit(0)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rss-hidden", type=int, default=1536)
    parser.add_argument("--rss-layers", type=int, default=25)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--case", action="append", default=[])
    known, rest = parser.parse_known_args()
    rest += [a for c in known.case for a in ("--case", c)]
    if known.hidden % 384 or known.rss_hidden % 384:
        raise SystemExit("--hidden/--rss-hidden must be multiples of 384 (heads of 128 at 4H/3, even H/2)")
    torch.set_num_threads(known.threads)

    def wanted(prefix: str) -> bool:
        return not known.case or any(c in prefix or prefix in c for c in known.case)

    def cases() -> Any:
        if wanted("forward_") or wanted("packed_pair_"):
            yield from forward_cases(known)
        if wanted("peak_rss_adaln_offload"):
            yield from rss_cases(known)

    raise SystemExit(main(cases, rest))
