"""LingBot MoE FFN against a naive per-token Python loop written from the spec text."""

from __future__ import annotations

import math

import pytest
import torch
from omni_lingbot.transformer.moe import LingBotMoE, grouped_linear

H, I_MOE, E = 16, 8, 8


def _moe(**overrides) -> LingBotMoE:
    kwargs = dict(num_experts=E, top_k=2, intermediate=I_MOE, n_shared_experts=1, score_func="sigmoid",
                  norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    kwargs.update(overrides)
    torch.manual_seed(0)
    moe = LingBotMoE(H, **kwargs)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
        moe.router.e_score_correction_bias.copy_(torch.randn(kwargs["num_experts"]) * 0.3)
    return moe


@torch.no_grad()
def _naive_selection(moe: LingBotMoE, row: torch.Tensor) -> tuple[list[int], list[float]]:
    """Per-token routing in float64 with Python lists: returns (chosen experts, their gate weights)."""
    w = moe.router.weight.double()
    bias = moe.router.e_score_correction_bias.double().tolist()
    n = w.shape[0]
    logits = [float(w[e] @ row.double()) for e in range(n)]
    if moe.score_func == "sigmoid":
        scores = [1.0 / (1.0 + math.exp(-z)) for z in logits]
    else:
        m = max(logits)
        ex = [math.exp(z - m) for z in logits]
        scores = [v / sum(ex) for v in ex]
    choice = [s + b for s, b in zip(scores, bias)]
    eligible = list(range(n))
    if moe.n_group is not None and moe.n_group > 1:
        size = n // moe.n_group
        group_score = []
        for g in range(moe.n_group):
            members = sorted((choice[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            group_score.append(sum(members[:2]))
        best_groups = sorted(range(moe.n_group), key=lambda g: -group_score[g])[: moe.topk_group]
        eligible = [e for e in range(n) if e // size in best_groups]
    chosen = sorted(eligible, key=lambda e: -choice[e])[: moe.top_k]
    gates = [scores[e] for e in chosen]  # ORIGINAL scores, not the biased ones
    if moe.top_k > 1 and moe.norm_topk_prob:
        total = sum(gates)
        gates = [g / (total + 1e-20) for g in gates]
    return chosen, [g * moe.routed_scaling_factor for g in gates]


def _expert(w1, w2, w3, x):
    a = w1.double() @ x
    return w2.double() @ (a * torch.sigmoid(a) * (w3.double() @ x))


@torch.no_grad()
def _naive_moe(moe: LingBotMoE, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    ex = moe.experts
    for t in range(x.shape[0]):
        row = x[t].double()
        if token_mask is None or bool(token_mask[t]):
            chosen, gates = _naive_selection(moe, row)
            for e, g in zip(chosen, gates):
                out[t] += g * _expert(ex.w1[e], ex.w2[e], ex.w3[e], row)
        if moe.shared_experts is not None:
            s = moe.shared_experts
            out[t] += _expert(s.gate_proj.weight, s.down_proj.weight, s.up_proj.weight, row)
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # sigmoid, group-limited (4 groups of 2, keep 2), shared expert
        {"n_group": None, "topk_group": None},
        {"score_func": "softmax", "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.0},
        {"norm_topk_prob": False, "n_shared_experts": None},
        {"top_k": 1, "n_group": None, "topk_group": None},
        {"top_k": 3, "n_shared_experts": 2, "n_group": 2, "topk_group": 2},
    ],
    ids=["grouped", "ungrouped", "softmax", "unnormalised-noshared", "top1", "top3-2shared"],
)
def test_routing_and_output_match_naive_loop(overrides):
    moe = _moe(**overrides)
    x = torch.randn(37, H)
    ids, weights = moe.route(x)
    for t in range(x.shape[0]):
        chosen, gates = _naive_selection(moe, x[t])
        assert ids[t].tolist() == chosen, t
        torch.testing.assert_close(weights[t].double(), torch.tensor(gates, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        got = moe(x)
    torch.testing.assert_close(got.double(), _naive_moe(moe, x), rtol=1e-4, atol=1e-4)


def test_correction_bias_changes_selection_but_not_weights():
    moe = _moe(n_group=None, topk_group=None)
    x = torch.randn(64, H)
    with torch.no_grad():
        moe.router.e_score_correction_bias.zero_()
        ids0, _ = moe.route(x)
        moe.router.e_score_correction_bias[3] = 10.0  # forces expert 3 into every token's top-k
        ids1, w1 = moe.route(x)
    assert (ids1 == 3).any(dim=1).all()
    assert not torch.equal(ids0, ids1)
    # weights are the ORIGINAL sigmoid scores at the chosen experts, normalised and scaled
    scores = torch.sigmoid(x @ moe.router.weight.t())
    picked = scores.gather(1, ids1)
    torch.testing.assert_close(w1, picked / picked.sum(-1, keepdim=True) * 2.5)


def test_group_limit_keeps_choices_inside_kept_groups():
    moe = _moe(n_group=4, topk_group=1)  # groups of 2 experts, one group kept, top-2 -> both experts of a group
    ids, _ = moe.route(torch.randn(50, H))
    assert (ids[:, 0] // 2 == ids[:, 1] // 2).all()


def test_padded_rows_get_only_shared_output():
    moe = _moe()
    x = torch.randn(20, H)
    mask = torch.rand(20) > 0.4
    mask[0], mask[1] = True, False
    with torch.no_grad():
        got = moe(x, mask)
        full = moe(x)
    torch.testing.assert_close(got.double(), _naive_moe(moe, x, mask), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[mask], full[mask])
    s = moe.shared_experts
    with torch.no_grad():
        torch.testing.assert_close(got[~mask], s(x[~mask]).float())
    moe.shared_experts = None
    with torch.no_grad():
        assert torch.count_nonzero(moe(x, mask)[~mask]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_paths_agree(dtype):
    torch.manual_seed(1)
    counts = [5, 0, 3, 9]
    x = torch.randn(sum(counts), 16, dtype=dtype)
    w = torch.randn(4, 24, 16, dtype=dtype)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    loop = grouped_linear(x, w, counts, offsets, "loop")
    expected, start = [], 0
    for e, n in enumerate(counts):
        expected.append(x[start:start + n].float() @ w[e].float().t())
        start += n
    tol = dict(rtol=2e-2, atol=2e-1) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loop.float(), torch.cat(expected), **tol)
    if hasattr(torch, "_grouped_mm"):
        try:
            gm = grouped_linear(x, w, counts, offsets, "grouped_mm")
        except RuntimeError as exc:  # some CPU builds lack a kernel for this dtype
            pytest.skip(f"torch._grouped_mm unavailable here: {exc}")
        torch.testing.assert_close(gm.float(), loop.float(), **tol)


def test_moe_module_grouped_mm_matches_loop():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch")
    moe = _moe()
    x = torch.randn(33, H)
    with torch.no_grad():
        a = moe(x)
        moe.grouped_impl = "grouped_mm"
        b = moe(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
