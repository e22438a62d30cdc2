"""Mixture-of-experts FFN of LingBot MoE blocks.

Routing (``route``): fp32 router logits -> sigmoid (or softmax) scores; experts are *selected* on
``scores + e_score_correction_bias`` (optionally group-limited: groups of ``E / n_group`` experts scored by the sum
of their top-2, only the best ``topk_group`` groups stay eligible) but *weighted* with the original scores at the
selected experts, normalised to sum 1 (``+1e-20``) when ``norm_topk_prob`` and ``top_k > 1``, then multiplied by
``routed_scaling_factor``. Routed experts run grouped: token copies are sorted by expert and each expert does one
GEMM on its contiguous slice (or one ``torch._grouped_mm``); results are scattered back with ``index_add_`` in
fp32. Shared experts are added to every row; rows flagged as padding receive no routed output.

Expert parallel (``--parallel ep=N``, :meth:`LingBotMoE.enable_expert_parallel`): each rank keeps a contiguous
``E / N`` of the routed experts; the router stays replicated, so top-k routing is the single-process choice. With
``dispatch="all_to_all"`` (the default) each rank sends the token copies of its slice of the tokens to the experts'
owners and gets their outputs back (``omnicore.plugin.ExpertDispatch``), then the slices are all-gathered; with
``"all_reduce"`` every rank runs its experts on the copies routed to them and the partial sums are all-reduced.
Shared experts run replicated on every rank.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from omnicore.plugin import ops as eager_ops
from torch import nn
from torch.nn import functional as F

from .ffn import SwiGLUFeedForward

GroupedImpl = Literal["auto", "loop", "grouped_mm"]


def route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    score_func: str = "sigmoid",
    n_group: int | None = None,
    topk_group: int | None = None,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(expert ids [T, k] int64, weights [T, k] fp32)``."""
    logits = logits.float()
    if score_func == "sigmoid":
        scores = torch.sigmoid(logits)
    elif score_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"unknown score_func {score_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group is not None and topk_group is not None and n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~kept[..., None], float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if top_k > 1 and norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


def resolve_impl(impl: GroupedImpl, x: torch.Tensor, weight: torch.Tensor | None = None) -> GroupedImpl:
    """``auto`` picks ``torch._grouped_mm`` for bf16 on CUDA (16-aligned dims) and the per-expert loop elsewhere."""
    if impl != "auto":
        return impl
    aligned = weight is None or (weight.shape[1] % 16 == 0 and weight.shape[2] % 16 == 0)
    fast = x.is_cuda and x.dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm")
    return "grouped_mm" if fast else "loop"


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: list[int], offsets: torch.Tensor, impl: GroupedImpl = "auto"
) -> torch.Tensor:
    """Rows of ``x`` sorted by expert (``counts[e]`` rows each) times ``weight[e].T`` (``weight [E, out, in]``).

    ``loop`` does one GEMM per non-empty expert (fastest on CPU, where ``_grouped_mm`` is a slow fallback);
    ``grouped_mm`` is one ``torch._grouped_mm`` call driven by the device-side ``offsets`` (no host sync).
    """
    impl = resolve_impl(impl, x, weight)
    if impl == "grouped_mm":
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    parts, start = [], 0
    for e, n in enumerate(counts):
        if n:
            parts.append(x[start:start + n] @ weight[e].t())
            start += n
    return torch.cat(parts, dim=0) if parts else x.new_zeros(0, weight.shape[1])


class MoERouter(nn.Module):
    """Router logits in fp32; ``e_score_correction_bias`` only shifts the *selection* (aux-loss-free balancing)."""

    e_score_correction_bias: torch.Tensor  # a buffer

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoEExperts(nn.Module):
    """Stacked SwiGLU experts: ``w2(silu(w1 x) * w3 x)`` with ``w1, w3 [E, I, H]`` and ``w2 [E, H, I]``."""

    ops: Any = eager_ops  # platform ops (``swiglu``); see norm.bind_ops
    #: expert parallel: this rank holds experts ``[first, first + len(w1))`` (``keep_experts``)
    first: int = 0

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.total = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        for w in (self.w1, self.w3, self.w2):  # nn.Linear's default init, per expert
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def keep_experts(self, first: int, count: int) -> None:
        """Expert parallel: keep experts ``[first, first + count)`` only (the others' weights are released)."""
        for name in ("w1", "w3", "w2"):
            kept = getattr(self, name).data[first:first + count].clone()
            setattr(self, name, nn.Parameter(kept, requires_grad=False))
        self.first = first

    def run_rows(self, rows: torch.Tensor, local_ids: torch.Tensor, impl: GroupedImpl = "auto") -> torch.Tensor:
        """One output row per input row: ``rows [N, H]`` each through local expert ``local_ids [N]`` (grouped by
        expert with a stable sort, so each expert sees its rows in the order given)."""
        order = torch.argsort(local_ids, stable=True)
        counts_t = torch.bincount(local_ids, minlength=self.w1.shape[0])
        offsets = torch.cumsum(counts_t, 0).to(torch.int32)
        xs = rows[order].to(self.w1.dtype)
        impl = resolve_impl(impl, xs, self.w1)
        counts = counts_t.tolist() if impl == "loop" else []
        gate = grouped_linear(xs, self.w1, counts, offsets, impl)
        h = self.ops.swiglu(gate, grouped_linear(xs, self.w3, counts, offsets, impl))
        y = grouped_linear(h, self.w2, counts, offsets, impl)
        out = torch.empty_like(y)
        out[order] = y
        return out

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        impl: GroupedImpl = "auto",
    ) -> torch.Tensor:
        """``x [T, H]``, ``ids/weights [T, k]`` -> fp32 ``[T, H]`` weighted sum of the selected experts (under
        expert parallel: of the selected experts this rank holds)."""
        t, k = ids.shape
        num_experts = self.w1.shape[0]
        flat_ids = ids.reshape(-1)
        flat_w = weights.reshape(-1).float()
        flat_tok = torch.arange(t, device=x.device).repeat_interleave(k)
        keep = None if token_mask is None else token_mask.to(torch.bool)[flat_tok]
        if self.first or num_experts != self.total:  # expert parallel: copies for other ranks' experts dropped
            mine = (flat_ids >= self.first) & (flat_ids < self.first + num_experts)
            keep = mine if keep is None else keep & mine
        if keep is not None:
            flat_ids, flat_w, flat_tok = flat_ids[keep] - self.first, flat_w[keep], flat_tok[keep]
        order = torch.argsort(flat_ids, stable=True)
        tok_sorted = flat_tok[order]
        counts_t = torch.bincount(flat_ids, minlength=num_experts)
        offsets = torch.cumsum(counts_t, 0).to(torch.int32)
        xs = x[tok_sorted].to(self.w1.dtype)
        impl = resolve_impl(impl, xs, self.w1)
        counts = counts_t.tolist() if impl == "loop" else []
        gate = grouped_linear(xs, self.w1, counts, offsets, impl)
        h = self.ops.swiglu(gate, grouped_linear(xs, self.w3, counts, offsets, impl))
        y = grouped_linear(h, self.w2, counts, offsets, impl)
        out = torch.zeros(t, x.shape[-1], dtype=torch.float32, device=x.device)
        return out.index_add_(0, tok_sorted, y.float() * flat_w[order, None])


class LingBotMoE(nn.Module):
    """MoE FFN: router + routed experts + optional shared experts (``n_shared_experts * moe_intermediate_size``)."""

    def __init__(
        self,
        hidden: int,
        *,
        num_experts: int,
        top_k: int,
        intermediate: int,
        n_shared_experts: int | None,
        score_func: str,
        norm_topk_prob: bool,
        n_group: int | None,
        topk_group: int | None,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.grouped_impl: GroupedImpl = "auto"
        self.router = MoERouter(hidden, num_experts)
        self.experts = MoEExperts(num_experts, hidden, intermediate)
        self.shared_experts = (
            SwiGLUFeedForward(hidden, intermediate * n_shared_experts) if n_shared_experts else None
        )

    #: expert parallel: ``(ExpertDispatch, ctx, dispatch mode)`` once enable_expert_parallel ran
    expert_parallel: Any = None

    def enable_expert_parallel(self, ctx: Any, dispatch: str = "all_to_all") -> None:
        """Keep this rank's ``1/ctx.ep`` of the routed experts (an expert count the degree does not divide is a
        ConfigError naming both) and route tokens to the other ranks' experts by ``dispatch``."""
        from omnicore.plugin import ExpertDispatch, check_dispatch

        check_dispatch(dispatch)
        per = self.keep_expert_share(ctx.ep_rank, ctx.ep)
        router = ExpertDispatch(rank=ctx.ep_rank, degree=ctx.ep, per_rank=per, group=ctx.ep_group, stats=ctx.stats)
        self.expert_parallel = (router, ctx, dispatch)

    def keep_expert_share(self, rank: int, degree: int) -> int:
        """Keep expert-parallel rank ``rank``'s contiguous ``1/degree`` of the routed experts (a count the degree
        does not divide is a ConfigError naming both); returns the experts per rank. The load and the planner's
        meta-device ``shard`` hook both narrow through here, so a plan's EP bytes are the load's."""
        from omnicore.plugin import check_expert_degree

        check_expert_degree(self.experts.total, degree)
        per = self.experts.total // degree
        if self.experts.w1.shape[0] != per:
            self.experts.keep_experts(rank * per, per)
        return per

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(
            self.router(x),
            self.router.e_score_correction_bias,
            top_k=self.top_k,
            score_func=self.score_func,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, H]`` -> fp32 ``[T, H]``; ``token_mask [T]`` (True = real) zeroes routed output on padding rows."""
        ids, weights = self.route(x)
        if self.expert_parallel is None:
            out = self.experts(x, ids, weights, token_mask, self.grouped_impl)
        elif self.expert_parallel[2] == "all_reduce":
            from omnicore.plugin import all_reduce_sum

            _, ctx, _ = self.expert_parallel
            out = all_reduce_sum(self.experts(x, ids, weights, token_mask, self.grouped_impl), ctx.ep_group,
                                 ctx.stats)
        else:
            out = _dispatched_forward(self, x, ids, weights, token_mask)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out


def _dispatched_forward(moe: LingBotMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        token_mask: torch.Tensor | None) -> torch.Tensor:
    """The routed experts' output under ``dispatch="all_to_all"``: this rank's token slice dispatched to the
    experts' owners, combined exactly as :meth:`MoEExperts.forward` does, then all-gathered."""
    dispatch = moe.expert_parallel[0]
    t, k = ids.shape
    part = dispatch.token_slice(t)
    n = part.stop - part.start
    flat_ids = ids[part].reshape(-1)
    flat_w = weights[part].reshape(-1).float()
    flat_tok = torch.arange(n, device=x.device).repeat_interleave(k)
    if token_mask is not None:
        keep = token_mask[part].to(torch.bool)[flat_tok]
        flat_ids, flat_w, flat_tok = flat_ids[keep], flat_w[keep], flat_tok[keep]
    experts, impl = moe.experts, moe.grouped_impl
    y = dispatch.run(x[part][flat_tok].to(experts.w1.dtype), flat_ids,
                     lambda rows, local: experts.run_rows(rows, local, impl))
    order = torch.argsort(flat_ids, stable=True)
    out = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=x.device)
    out.index_add_(0, flat_tok[order], y[order].float() * flat_w[order, None])
    return dispatch.gather(out, t)

