"""Multi-process DiT step (``omnicore.parallel``): step time vs world size, scaling efficiency, bytes per step.

One guided LingBot DiT step (both CFG branches) at a size where compute dominates (hidden 512, 8 heads, depth 4,
1536 video tokens and 160 / 96 text tokens per branch), timed three ways in the same ``torch.multiprocessing``
group (gloo on CPU, NCCL with ``--device cuda``):

* arm B, ``world1``: rank 0 alone runs the step as the single-process engine does (cond, then uncond);
* arm A, ``cfg2``: each rank runs one branch, predictions exchanged (``cfg_branches``);
* arm A, ``ulysses2``: both ranks run both branches on half the rows each (Ulysses attention all-to-all).

Arms alternate (A B, B A, ...) after warm-up. Every rank, and the single-process arm, uses ``cpus / world`` threads
(one "device" each on CPU), so the speedup is that of adding devices. Per case it prints the time record
(``ratio`` = parallel / single; ``speedup``; ``scaling_efficiency`` = speedup / world) with the goal of the issue
(≥ 1.8× at 2 ranks, i.e. ``ratio <= 0.556`` — meant for GPUs; 2 busy CPU cores will not reach it), and a
communication record: bytes rank 0 sent per step (counted by the collectives) vs the analytic value
``cfg: numel(prediction) * 4 B``; ``ulysses: depth * 4 * (T/P) * hidden * 4 B * (P-1)/P + (T/P) * hidden * 4 B *
(P-1)`` (q, k, v and the output per attention call, and the final row gather), per branch.

Tensor parallel (``tp2``): one MiniMax-H3 DiT forward (hidden 512, 8 heads, 4 blocks, FFN 2048, one request of
1536 video + 96 audio + 64 text rows) on rank 0 alone vs split over 2 ranks (DTensor column/row-parallel linears).
Records: the time; bytes rank 0 sent per step (each row-parallel layer's all-reduce, counted at the call as a ring
sends it) vs the analytic ``blocks * 2 * T * hidden * 4 B * 2 (P-1)/P``; and rank 0's resident parameter bytes vs
the analytic share of the plan and vs the single-rank model.

Expert parallel (``ep2``): one HunyuanImage-3 MoE layer (hidden 1024, 16 experts of width 1024, top-4, a shared
MLP; 2048 tokens) on rank 0 alone vs its experts partitioned over 2 ranks, both ways the models offer
(``ep_dispatch``): token copies dispatched to their experts' rank and back by all-to-all plus a gather of the token
slices, or each rank's share all-reduced. Records the time per arm, the bytes per step of each vs its analytic value
(``omnicore.parallel.experts.expert_bytes_per_layer``: all-reduce ``T * hidden * 4 B * 2 (P-1)/P``; all-to-all
``k T/P (P-1)/P (2 hidden * 4 B + 4) + (P-1) T/P hidden * 4 B`` under uniform routing), the ratio of the two, and
rank 0's expert bytes vs half the layer's.

Parallel VAE decode (``vae2``): each model's tiled VAE decode (the tiny presets' VAEs on larger frames: LingBot's
Wan VAE, 9 frames 128 x 128 in a 3 x 3 tile grid; MiniMax-H3's native tiles, 9 frames 256 x 384, 3 x 4; the
HunyuanImage-3 VAE, 96 x 96, 2 x 2) on rank 0 alone vs its tiles shared round-robin over 2 ranks and blended on
rank 0 (``omnicore.parallel.vae_decode.decode_tiles``). Records the time per arm, ``max_abs_diff`` between the two
(0: the parallel frames are the single-rank tiled decode's bit for bit), and the bytes rank 1 sent (its decoded
tiles, float32) vs the analytic sum of its tiles' sizes.

Four ranks (``tp4``, ``ep4``): the same TP and EP cases over 4 processes (goal ≥ 3.2×, ``ratio <= 0.3125``);
on 2 CPU cores each rank gets one thread and the four share two cores, so expect a slowdown.

Run: ``python benchmarks/parallel.py [--reps N] [--device cuda] [--case cfg2|ulysses2|tp2|ep2|vae2|tp4|ep4]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import emit, environment, ratio_at_most, skipped, static_case, within  # noqa: E402

CONFIG = dict(patch_size=[1, 2, 2], in_channels=16, out_channels=16, hidden_size=512, num_attention_heads=8, depth=4,
              intermediate_size=1536, text_dim=256, freq_dim=256, axes_dims=[16, 24, 24], axes_lens=[1024, 256, 256])
LATENT = (1, 16, 4, 32, 48)  # B, C, F, H, W: 4 x 16 x 24 = 1536 video tokens (patch 1x2x2)
TEXT = (160, 96)  # cond / uncond text lengths


def _rank(rank: int, world: int, init: str, reps: int, warmup: int, device: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from omni_lingbot.transformer.config import LingBotTransformerConfig
    from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel
    from omnicore.parallel.cfg import cfg_branches
    from omnicore.parallel.config import ParallelConfig
    from omnicore.parallel.context import build_groups

    threads = max(1, (os.cpu_count() or 2) // world)
    torch.set_num_threads(threads)
    dev = torch.device(device if device == "cpu" else f"{device}:{rank}")
    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"file://{init}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    config = LingBotTransformerConfig(**CONFIG)
    single = LingBotVideoTransformer3DModel(config).to(dev).eval()
    sharded = LingBotVideoTransformer3DModel(config).to(dev).eval()
    sharded.load_state_dict(single.state_dict())
    ctx_u = build_groups(ParallelConfig(ulysses=world), rank)
    ctx_c = build_groups(ParallelConfig(cfg=world), rank)
    sharded.enable_ulysses(ctx_u)
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(LATENT, generator=g).to(dev)
    t = torch.full((1,), 500.0, device=dev)
    texts = [torch.randn(1, n, CONFIG["text_dim"], generator=g).to(dev) for n in TEXT]

    def branch(model, i):  # type: ignore[no-untyped-def]
        return lambda: model(hidden_states=lat, timestep=t, encoder_hidden_states=texts[i])

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize(dev)

    arms = {
        "world1": lambda: [branch(single, 0)(), branch(single, 1)()],
        "cfg2": lambda: cfg_branches(ctx_c, [branch(single, 0), branch(single, 1)]),
        "ulysses2": lambda: [branch(sharded, 0)(), branch(sharded, 1)()],
    }
    results: dict[str, list[float]] = {k: [] for k in arms}
    comm: dict[str, int] = {}
    outputs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i in range(warmup + reps):
            order = ["world1", "cfg2", "ulysses2"] if i % 2 == 0 else ["ulysses2", "cfg2", "world1"]
            for name in order:
                dist.barrier()
                if name == "world1" and rank != 0:  # the single-process arm: rank 0 alone, the others wait
                    continue
                ctx_c.stats.reset()
                ctx_u.stats.reset()
                sync()
                start = time.perf_counter()
                got = arms[name]()
                sync()
                if i >= warmup:
                    results[name].append(time.perf_counter() - start)
                comm[name] = (ctx_c.stats.snapshot()["total_sent_bytes"] + ctx_u.stats.snapshot()["total_sent_bytes"])
                outputs[name] = torch.stack([o.float().cpu() for o in got])
            dist.barrier()
    if rank == 0:
        torch.save({"times": results, "comm": comm,
                    "diff": {k: float((outputs[k] - outputs["world1"]).abs().max()) for k in ("cfg2", "ulysses2")},
                    "threads": threads, "numel": outputs["world1"][0].numel(),
                    "tokens": sharded.forward_metadata(lat, texts[0]).layout.total,
                    "tokens_uncond": sharded.forward_metadata(lat, texts[1]).layout.total}, out)
    dist.destroy_process_group()


H3 = dict(num_layers=4, num_refiner_layers=1, hidden_size=512, num_attention_heads=8, attention_head_dim=64,
          ffn_dim=2048, in_channels=24, audio_in_channels=32, patch_size=[1, 2, 2], text_dim=256, freq_dim=256,
          time_embed_hidden_dim=512, time_embed_dim=256, rope_freq_dim=8)
H3_ROWS = (64, 96, 1536)  # text, audio, video rows of the one request


def _h3_batch(dit):  # type: ignore[no-untyped-def]
    """A one-request packed batch for ``dit`` and its inputs (positions need not be meaningful to time a step)."""
    import torch
    from omni_minimax_h3.transformer.layout import RequestLayout

    nt, na, nv = H3_ROWS
    used = nt + na + nv
    tags = torch.tensor([1] * nt + [2] * na + [0] * nv)
    pos = torch.stack([torch.arange(used, dtype=torch.float64) % 16] * 3, dim=1)
    layout = RequestLayout.build(pos, tags, torch.arange(nt + na, used), torch.arange(nt, nt + na), torch.arange(nt),
                                 seq_align=1)
    g = torch.Generator().manual_seed(2)
    c = dit.config
    plan = dit.prepare_request(layout, torch.randn(nt, c.text_dim, generator=g))
    batch = dit.pack([plan])
    ts = batch.step_timesteps([0.5], [0.5])
    video = torch.randn(nv, c.video_patch_dim, generator=g)
    audio = torch.randn(na, c.audio_in_channels, generator=g)
    return batch, video, audio, ts


def _tp_rank(rank: int, world: int, init: str, reps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from omni_minimax_h3.transformer.config import MiniMaxH3TransformerConfig
    from omni_minimax_h3.transformer.model import MiniMaxH3DiT
    from omni_minimax_h3.transformer.tensor_parallel import module_plan
    from omnicore.parallel.config import ParallelConfig
    from omnicore.parallel.context import build_groups
    from omnicore.parallel.tensor_parallel import local_parameter_bytes, sharded_parameter_bytes

    threads = max(1, (os.cpu_count() or 2) // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ctx = build_groups(ParallelConfig(tp=world), rank)
    torch.manual_seed(0)
    config = MiniMaxH3TransformerConfig.from_dict(H3)
    single = MiniMaxH3DiT(config).eval().requires_grad_(False)
    for p in single.parameters():  # a unit-variance-ish random init (the module's own init leaves ones / zeros)
        p.data.normal_(0.0, 0.02)
    split = MiniMaxH3DiT(config).eval().requires_grad_(False)
    split.load_state_dict(single.state_dict())
    full_bytes = local_parameter_bytes(split)
    split.enable_tensor_parallel(ctx)
    batch, video, audio, ts = _h3_batch(single)
    arm = f"tp{world}"
    arms = {"world1": lambda: single(batch, video, audio, ts.unique_timesteps, ts.inverse_indices),
            arm: lambda: split(batch, video, audio, ts.unique_timesteps, ts.inverse_indices)}
    times: dict[str, list[float]] = {k: [] for k in arms}
    got: dict[str, Any] = {}
    sent = 0
    with torch.no_grad():
        for i in range(warmup + reps):
            for name in (["world1", arm] if i % 2 == 0 else [arm, "world1"]):
                dist.barrier()
                if name == "world1" and rank != 0:
                    continue
                ctx.stats.reset()
                start = time.perf_counter()
                v, a = arms[name]()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
                got[name] = torch.cat([v.float().flatten(), a.float().flatten()])
                if name == arm:
                    sent = ctx.stats.snapshot()["sent_bytes"].get("all_reduce", 0)
            dist.barrier()
    if rank == 0:
        torch.save({"times": times, "sent": sent, "threads": threads, "tokens": batch.total,
                    "diff": float((got[arm] - got["world1"]).abs().max()), "full_bytes": full_bytes,
                    "local_bytes": local_parameter_bytes(split),
                    "analytic_bytes": sharded_parameter_bytes(MiniMaxH3DiT(config), module_plan(config), world)},
                   out)
    dist.destroy_process_group()


def _tp_main(args: Any, world: int = 2) -> None:
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_tp_rank, args=(world, os.path.join(tmp, "rendezvous"), args.reps, args.warmup, out), nprocs=world,
                 join=True)
        r = torch.load(out)
    base, med = statistics.median(r["times"]["world1"]), statistics.median(r["times"][f"tp{world}"])
    case = f"h3_h512_d4_{r['tokens']}tok_tp{world}_cpu"
    record = {"benchmark": "parallel", "case": case, "arm_a": f"tp{world} ({world} ranks x {r['threads']} threads)",
              "arm_b": f"world1 (1 rank x {r['threads']} threads)", "a_median_s": med, "b_median_s": base,
              "ratio": med / base, "speedup": base / med, "scaling_efficiency": base / med / world,
              "max_abs_diff": r["diff"], "reps": args.reps, "env": environment()}
    goal = ratio_at_most(GOAL_RATIO[world])
    record["goal"] = goal.describe() + " (GPU goal; CPU reported)"
    record["met"] = goal.met(record)
    emit(record)
    analytic = H3["num_layers"] * 2 * r["tokens"] * H3["hidden_size"] * 4 * 2 * (world - 1) // world
    emit(static_case("parallel", f"tp{world}_bytes_per_step", "measured", "analytic",
                     {"a_value": r["sent"], "b_value": analytic}, within(1.0, 0.01)))
    emit(static_case("parallel", f"tp{world}_rank0_weight_bytes", "resident", "analytic share",
                     {"a_value": r["local_bytes"], "b_value": r["analytic_bytes"], "single_rank_bytes": r["full_bytes"],
                      "share_of_single_rank": r["local_bytes"] / r["full_bytes"]}, within(1.0, 0.001)))


#: the issue's GPU goals as a ratio of medians: >= 1.8x at 2 ranks, >= 3.2x at 4
GOAL_RATIO = {2: 1 / 1.8, 4: 1 / 3.2}

MOE = dict(hidden_size=1024, moe_topk=4, num_experts=16, moe_intermediate_size=1024, use_mixed_mlp_moe=True,
           num_shared_expert=1)
MOE_TOKENS = 2048


def _ep_rank(rank: int, world: int, init: str, reps: int, warmup: int, out: str) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from omni_hunyuan.transformer.blocks import MoE
    from omni_hunyuan.transformer.model import HunyuanImage3
    from omnicore.parallel.config import ParallelConfig
    from omnicore.parallel.context import build_groups
    from omnicore.parallel.tensor_parallel import local_parameter_bytes

    threads = max(1, (os.cpu_count() or 2) // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ctx = build_groups(ParallelConfig(ep=world), rank)
    torch.manual_seed(0)
    config = SimpleNamespace(**MOE)
    single = MoE(config).eval().requires_grad_(False)  # type: ignore[arg-type]
    arms: dict[str, Any] = {"world1": single}
    for mode in ("all_reduce", "all_to_all"):
        split = MoE(config).eval().requires_grad_(False)  # type: ignore[arg-type]
        split.load_state_dict(single.state_dict())
        holder = SimpleNamespace(config=SimpleNamespace(num_experts=MOE["num_experts"]),
                                 modules=lambda split=split: [split.experts])
        HunyuanImage3.enable_expert_parallel(holder, ctx, mode)  # type: ignore[arg-type]  # the model's own code
        arms[f"ep{world}_{mode}"] = split
    x = torch.randn(MOE_TOKENS, MOE["hidden_size"], generator=torch.Generator().manual_seed(1))
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    got: dict[str, Any] = {}
    sent: dict[str, int] = {}
    with torch.no_grad():
        for i in range(warmup + reps):
            for name in (names if i % 2 == 0 else names[::-1]):
                dist.barrier()
                if name == "world1" and rank != 0:
                    continue
                ctx.stats.reset()
                start = time.perf_counter()
                got[name] = arms[name](x)
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
                if name != "world1":
                    sent[name] = ctx.stats.snapshot()["total_sent_bytes"]
            dist.barrier()
    if rank == 0:
        torch.save({"times": times, "sent": sent, "threads": threads,
                    "diff": {n: float((got[n] - got["world1"]).abs().max()) for n in names[1:]},
                    "expert_bytes": local_parameter_bytes(arms[f"ep{world}_all_to_all"].experts),
                    "single_expert_bytes": local_parameter_bytes(single.experts)}, out)
    dist.destroy_process_group()


def _ep_main(args: Any, world: int = 2) -> None:
    import torch
    import torch.multiprocessing as mp
    from omnicore.parallel.experts import expert_bytes_per_layer

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_ep_rank, args=(world, os.path.join(tmp, "rendezvous"), args.reps, args.warmup, out), nprocs=world,
                 join=True)
        r = torch.load(out)
    base = statistics.median(r["times"]["world1"])
    analytic = expert_bytes_per_layer(MOE_TOKENS, MOE["moe_topk"], world, MOE["hidden_size"], 4)
    for mode in ("all_reduce", "all_to_all"):
        med = statistics.median(r["times"][f"ep{world}_{mode}"])
        record = {"benchmark": "parallel", "case": f"hunyuan_moe_h1024_e16_{MOE_TOKENS}tok_ep{world}_{mode}_cpu",
                  "arm_a": f"ep{world} {mode} ({world} ranks x {r['threads']} threads)",
                  "arm_b": f"world1 (1 rank x {r['threads']} threads)", "a_median_s": med, "b_median_s": base,
                  "ratio": med / base, "speedup": base / med, "scaling_efficiency": base / med / world,
                  "max_abs_diff": r["diff"][f"ep{world}_{mode}"], "reps": args.reps, "env": environment()}
        goal = ratio_at_most(GOAL_RATIO[world])
        record["goal"] = goal.describe() + " (GPU goal; CPU reported)"
        record["met"] = goal.met(record)
        emit(record)
        # all-reduce bytes are exact; all-to-all's depend on where the router sends each copy (analytic: uniform)
        emit(static_case("parallel", f"ep{world}_{mode}_bytes_per_step", "measured", "analytic",
                         {"a_value": r["sent"][f"ep{world}_{mode}"], "b_value": analytic[mode]},
                         within(1.0, 0.01 if mode == "all_reduce" else 0.15)))
    emit(static_case("parallel", f"ep{world}_bytes_all_to_all_vs_all_reduce", "all_to_all", "all_reduce",
                     {"a_value": r["sent"][f"ep{world}_all_to_all"], "b_value": r["sent"][f"ep{world}_all_reduce"],
                      "note": "tokens are replicated over the EP group: dispatch sends k copies, the all-reduce one "
                              "partial sum per token"}, within(analytic["all_to_all"] / analytic["all_reduce"], 0.15)))
    emit(static_case("parallel", f"ep{world}_rank0_expert_bytes", "resident", "analytic share",
                     {"a_value": r["expert_bytes"], "b_value": r["single_expert_bytes"] // world,
                      "single_rank_bytes": r["single_expert_bytes"]}, within(1.0, 0.001)))


def _vae_arms(ctx: Any) -> dict[str, tuple[Any, Any, int]]:
    """Per model: ``(single, parallel, bytes rank 1's tiles weigh)``; ``single`` is the plain tiled decode."""
    import torch
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLWan
    from omni_hunyuan.presets import TINY_VAE as HUNYUAN_VAE
    from omni_hunyuan.vae import AutoencoderKLConv3D
    from omni_hunyuan.vae_tiling import VaeTiles, tile_starts, tiled_decode
    from omni_lingbot.presets import TINY_VAE as WAN_VAE
    from omni_lingbot.stage_options import VaeTiling
    from omni_lingbot.vae import LingBotVAE
    from omni_minimax_h3.presets import TINY_VAE as H3_VAE
    from omni_minimax_h3.vae import H3VideoVAE

    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    wan = AutoencoderKLWan(**WAN_VAE).eval().requires_grad_(False)
    lingbot, z_wan, wan_tiles = LingBotVAE(wan), torch.randn(1, 4, 3, 16, 16, generator=g), VaeTiling(64, 64, 48, 48)
    torch.manual_seed(0)
    h3_vae = AutoencoderKLMiniMaxH3(**H3_VAE).eval().requires_grad_(False)
    h3_vae.enable_tiling(128, 128, 32, 32)
    h3, z_h3 = H3VideoVAE(h3_vae), torch.randn(1, 24, 3, 16, 24, generator=g)
    torch.manual_seed(0)
    hunyuan, z_hy, hy_tiles = (AutoencoderKLConv3D(HUNYUAN_VAE).eval().requires_grad_(False),
                               torch.randn(1, 4, 6, 6, generator=g), VaeTiles(64, 32))

    def lingbot_single() -> Any:
        with lingbot.tiling(wan_tiles):
            return lingbot.decode(z_wan)

    def lingbot_parallel() -> Any:
        with lingbot.tiling(wan_tiles):
            return lingbot.decode_over_ranks(z_wan, ctx)

    # bytes of rank 1's tiles (float32, odd tile indices): Wan's tiles are 9 frames, edge tiles narrower
    wan_grid = [(i, j) for i in range(0, 16, 6) for j in range(0, 16, 6)]
    wan_bytes = sum(3 * 9 * min(64, 128 - 8 * i) * min(64, 128 - 8 * j) * 4 for k, (i, j) in enumerate(wan_grid)
                    if k % 2 == 1)
    # H3 decodes each temporal clip's tiles in turn: the sizes of the decoder's outputs in a single-rank decode,
    # per clip, odd tiles (rank 1's) summed
    n_h3 = len(h3_vae._split_tiles(256, 128, 32)[0]) * len(h3_vae._split_tiles(384, 128, 32)[0])
    sizes: list[int] = []
    hook = h3_vae.decoder.register_forward_hook(lambda _m, _a, out: sizes.append(out.numel()))
    with torch.no_grad():
        h3.decode(z_h3)
    hook.remove()
    h3_bytes = sum(n * 4 for k, n in enumerate(sizes) if k % n_h3 % 2 == 1)
    hy_bytes = (len(tile_starts(6, 4, 2)) ** 2 // 2) * 3 * 64 * 64 * 4
    return {
        "lingbot_wan_9f_128x128": (lingbot_single, lingbot_parallel, wan_bytes),
        "h3_native_9f_256x384": (lambda: h3.decode(z_h3), lambda: h3.decode(z_h3, parallel=ctx), h3_bytes),
        "hunyuan_96x96": (lambda: tiled_decode(hunyuan.decode, z_hy, hy_tiles),
                            lambda: tiled_decode(hunyuan.decode, z_hy, hy_tiles, ctx), hy_bytes),
    }


def _vae_rank(rank: int, world: int, init: str, reps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from omnicore.parallel.config import ParallelConfig
    from omnicore.parallel.context import build_groups

    threads = max(1, (os.cpu_count() or 2) // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ctx = build_groups(ParallelConfig(tp=world), rank)
    models = _vae_arms(ctx)
    result: dict[str, Any] = {"threads": threads}
    with torch.no_grad():
        for model, (single, parallel, analytic) in models.items():
            times: dict[str, list[float]] = {"world1": [], "vae2": []}
            got: dict[str, Any] = {}
            sent = 0
            for i in range(warmup + reps):
                for name in (["world1", "vae2"] if i % 2 == 0 else ["vae2", "world1"]):
                    dist.barrier()
                    if name == "world1" and rank != 0:
                        continue
                    ctx.stats.reset()
                    start = time.perf_counter()
                    got[name] = single() if name == "world1" else parallel()
                    if i >= warmup:
                        times[name].append(time.perf_counter() - start)
                    if name == "vae2":
                        sent = ctx.stats.snapshot()["sent_bytes"].get("vae_gather", 0)
                dist.barrier()
            sent_by = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(sent_by, torch.tensor([sent], dtype=torch.int64))
            if rank == 0:
                result[model] = {"times": times, "rank1_sent": int(sent_by[1]), "analytic": analytic,
                                 "diff": float((got["vae2"] - got["world1"]).abs().max())}
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def _vae_main(args: Any) -> None:
    import torch
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_vae_rank, args=(world, os.path.join(tmp, "rendezvous"), args.reps, args.warmup, out),
                 nprocs=world, join=True)
        r = torch.load(out)
    for model in ("lingbot_wan_9f_128x128", "h3_native_9f_256x384", "hunyuan_96x96"):
        m = r[model]
        base, med = statistics.median(m["times"]["world1"]), statistics.median(m["times"]["vae2"])
        record = {"benchmark": "parallel", "case": f"vae_decode_{model}_vae2_cpu",
                  "arm_a": f"vae2 ({world} ranks x {r['threads']} threads)",
                  "arm_b": f"world1 (1 rank x {r['threads']} threads)", "a_median_s": med, "b_median_s": base,
                  "ratio": med / base, "speedup": base / med, "scaling_efficiency": base / med / world,
                  "max_abs_diff": m["diff"], "reps": args.reps, "env": environment()}
        goal = ratio_at_most(0.556)
        record["goal"] = goal.describe() + " (GPU goal; CPU reported)"
        record["met"] = goal.met(record)
        emit(record)
        emit(static_case("parallel", f"vae2_{model}_rank1_bytes", "measured", "analytic",
                         {"a_value": m["rank1_sent"], "b_value": m["analytic"]}, within(1.0, 0.001)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--case", action="append", default=[])
    args = parser.parse_args()
    extra = {"tp": _tp_main, "ep": _ep_main, "vae": _vae_main}
    for key, run in extra.items():
        for world in (2, 4):  # --case tp2 / tp (2 ranks), tp4 (4 ranks); the VAE case runs on 2
            if not any(c == f"{key}{world}" or (world == 2 and c == key) for c in args.case):
                continue
            if args.device != "cpu":
                emit(skipped("parallel", f"the {key}{world} case runs on CPU/gloo only so far"))
            elif world == 2:
                run(args)
            elif key != "vae":
                run(args, world)
    if args.case and all(any(key in c for key in extra) for c in args.case):
        return 0
    import torch
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "rendezvous"), args.reps, args.warmup, args.device, out),
                 nprocs=world, join=True)
        result = torch.load(out)
    times, comm = result["times"], result["comm"]
    base = statistics.median(times["world1"])
    hidden, depth = CONFIG["hidden_size"], CONFIG["depth"]
    analytic = {
        "cfg2": result["numel"] * 4 * (world - 1),
        "ulysses2": sum(depth * 4 * (n // world) * hidden * 4 * (world - 1) // world + (n // world) * hidden * 4
                        * (world - 1) for n in (result["tokens"], result["tokens_uncond"])),
    }
    for name in ("cfg2", "ulysses2"):
        if args.case and not any(c in name for c in args.case):
            continue
        med = statistics.median(times[name])
        record = {"benchmark": "parallel", "case": f"lingbot_h512_d4_{result['tokens']}tok_{name}_{args.device}",
                  "arm_a": f"{name} ({world} ranks x {result['threads']} threads)",
                  "arm_b": f"world1 (1 rank x {result['threads']} threads)",
                  "a_median_s": med, "b_median_s": base, "ratio": med / base, "speedup": base / med,
                  "scaling_efficiency": base / med / world, "max_abs_diff": result["diff"][name],
                  "reps": args.reps, "env": environment()}
        goal = ratio_at_most(0.556)  # >= 1.8x at 2 ranks (the issue's GPU goal)
        record["goal"] = goal.describe() + " (GPU goal; CPU reported)"
        record["met"] = goal.met(record)
        emit(record)
        emit(static_case("parallel", f"{name}_bytes_per_step", "measured", "analytic",
                         {"a_value": comm[name], "b_value": analytic[name]}, within(1.0, 0.01)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
