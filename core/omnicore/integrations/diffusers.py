"""Helpers for plugins that wrap diffusers models (the core never imports diffusers itself).

``route_diffusers_attention(model, options)`` makes every standard attention module of a diffusers model run the
backend omnicore selects for it: per distinct (dtype, head dim) one :class:`~omnicore.specs.AttentionRequirement` goes
through ``options.attention`` (so ``--attention-backend`` and backend plugins apply), and each module's processor
becomes a :class:`SelectedAttention` calling that backend. Only modules on diffusers' plain processors
(``AttnProcessor2_0`` / ``AttnProcessor``) are routed; joint or fused processors (SD3, Flux ...) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..specs import dtype_name

if TYPE_CHECKING:
    import torch
    from diffusers.models.attention_processor import Attention
    from torch import nn

    from ..engine.protocol import LoadOptions

ROUTABLE_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor")


class SelectedAttention:
    """A diffusers attention processor: ``AttnProcessor2_0``'s steps with SDPA replaced by ``attention``.

    ``attention(q, k, v, attn_mask=...)`` is an omnicore backend (dense ``[B, S, H, D]`` layout). Masks are
    passed as booleans (True = attend): a float mask is read as diffusers' additive bias, where ``0`` attends
    and a large negative value (``-10000``, ``-inf``) masks; soft biases are not supported.
    """

    def __init__(self, attention: Callable[..., torch.Tensor]) -> None:
        self.attention = attention

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                 **_: object) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        image = hidden_states.ndim == 4
        if image:
            b, c, h, w = hidden_states.shape
            hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)
        batch = hidden_states.shape[0]
        mask = None
        if attention_mask is not None:
            mask = attention_mask.reshape(batch, 1, -1, attention_mask.shape[-1])  # [B, 1, Sq or 1, Sk]
            mask = mask > -1.0 if mask.is_floating_point() else mask
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if encoder_hidden_states is not None and attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)
        q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (attn.to_q(hidden_states), attn.to_k(context),
                                                                attn.to_v(context)))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        out = self.attention(q, k, v, attn_mask=mask).flatten(2).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if image:
            out = out.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def route_diffusers_attention(model: nn.Module, options: LoadOptions) -> int:
    """Install :class:`SelectedAttention` on every routable attention module of ``model``; returns how many.

    ``options`` is the pipeline's :class:`~omnicore.engine.protocol.LoadOptions` (its ``platform`` and
    ``attention`` selector). Does nothing (returns 0) when ``options.attention`` is ``None``.
    """
    from diffusers.models.attention_processor import Attention

    if options.attention is None:
        return 0
    chosen: dict[tuple[str, int], SelectedAttention] = {}
    routed = 0
    for module in model.modules():
        if not isinstance(module, Attention) or type(module.processor).__name__ not in ROUTABLE_PROCESSORS:
            continue
        key = (dtype_name(module.to_q.weight.dtype), module.inner_dim // module.heads)
        if key not in chosen:
            chosen[key] = SelectedAttention(options.attention(options.attention_requirement(*key)))
        processor: Any = chosen[key]  # duck-typed: diffusers calls it like an AttnProcessor
        module.set_processor(processor)
        routed += 1
    return routed
