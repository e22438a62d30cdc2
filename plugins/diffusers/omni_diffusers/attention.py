"""``--attention-backend`` on a diffusers pipeline: its denoiser's attention through omnicore's backend selection.

diffusers' attention modules call a *processor*; two kinds can be routed without forking diffusers:

- the plain ``AttnProcessor2_0`` / ``AttnProcessor`` (SD / SDXL UNets, PixArt, the VAEs' mid-block attention):
  omnicore's own :func:`~omnicore.plugin.route_diffusers_attention` replaces them;
- processors that compute projections, norms and rotary embeddings themselves and hand the attention proper to
  diffusers' dispatcher, ``dispatch_attention_fn(query, key, value, ...)`` in ``[B, S, H, D]`` (FLUX, Wan,
  QwenImage, HunyuanVideo, LTX ...). Such a processor keeps its object (its state and ``__call__`` signature,
  which diffusers' modules inspect) and gets a class of its own whose ``__call__`` is the same code with
  ``dispatch_attention_fn`` bound to :class:`RoutedDispatch` — nothing global in diffusers changes, and another
  pipeline in the same process keeps diffusers' dispatcher.

:class:`RoutedDispatch` selects one omnicore backend per (dtype, head dim) at load (the engine counts those
selections) and calls it with the boolean mask, scale and causality diffusers passes. What omnicore's backends do
not express — dropout, a float (additive) mask, diffusers' own context parallelism, a backend the user set on the
module with diffusers' ``set_attention_backend`` — goes to diffusers' dispatcher unchanged.

A pipeline honours ``--attention-backend`` when every attention module of its denoisers was routed; one whose
processors call SDPA directly (SD3's joint processor, for instance) declares it does not, and the engine refuses a
forced backend for it, naming the pipeline.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from omnicore.plugin import LoadOptions, route_diffusers_attention

DISPATCH = "dispatch_attention_fn"


@attrs.define
class AttentionRoute:
    """What routing did to one pipeline: denoiser attention modules routed, and the processor classes left
    alone (their attention stays diffusers')."""

    routed: int = 0
    unrouted: tuple[str, ...] = ()

    @property
    def honours_backend(self) -> bool:
        return self.routed > 0 and not self.unrouted


class RoutedDispatch:
    """Stands in for diffusers' ``dispatch_attention_fn`` inside routed processors (same signature)."""

    def __init__(self, options: LoadOptions, fallback: Callable[..., Any]) -> None:
        self.options, self.fallback = options, fallback
        self.chosen: dict[tuple[torch.dtype, int], Callable[..., Any]] = {}
        self.fallback_calls = 0

    def select(self, dtype: torch.dtype, head_dim: int) -> Callable[..., Any]:
        key = (dtype, head_dim)
        if key not in self.chosen:
            selected = self.options.select_attention(dtype, head_dim)
            if selected is None:
                raise RuntimeError("attention routing needs LoadOptions.attention (the engine's selector)")
            self.chosen[key] = selected
        return self.chosen[key]

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, enable_gqa: bool = False, attention_kwargs: dict[str, Any] | None = None,
                 *, backend: Any = None, parallel_config: Any = None) -> torch.Tensor:
        float_mask = attn_mask is not None and attn_mask.dtype != torch.bool
        if dropout_p or float_mask or backend is not None or parallel_config is not None or attention_kwargs:
            self.fallback_calls += 1
            return self.fallback(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs,
                                 backend=backend, parallel_config=parallel_config)
        # omnicore backends share diffusers' [B, S, H, D] layout and read grouped K/V heads themselves (enable_gqa)
        kwargs: dict[str, Any] = {"causal": True} if is_causal else {}
        if attn_mask is not None:
            kwargs["attn_mask"] = attn_mask
        if scale is not None:
            kwargs["scale"] = scale
        out: torch.Tensor = self.select(query.dtype, query.shape[-1])(query, key, value, **kwargs)
        return out


def _dispatching(processor: Any) -> bool:
    call: Any = next((vars(c)["__call__"] for c in type(processor).__mro__ if "__call__" in vars(c)), None)
    code = getattr(call, "__code__", None)
    return code is not None and DISPATCH in code.co_names and DISPATCH in getattr(call, "__globals__", {})


def _routed_class(cls: type, dispatch: RoutedDispatch, made: dict[type, type]) -> type:
    """``cls`` with its ``__call__`` re-bound to ``dispatch`` (one subclass per class and pipeline)."""
    if cls not in made:
        call: Any = cls.__call__
        rebound = types.FunctionType(call.__code__, {**call.__globals__, DISPATCH: dispatch}, call.__name__,
                                     call.__defaults__, call.__closure__)
        rebound.__kwdefaults__ = call.__kwdefaults__
        rebound.__qualname__, rebound.__doc__ = call.__qualname__, call.__doc__
        made[cls] = type(cls.__name__, (cls,), {"__call__": rebound, "__module__": cls.__module__,
                                                "omnicore_routed": True})
    return made[cls]


def _head_dim(module: Any) -> int | None:
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    inner, heads = getattr(module, "inner_dim", None), getattr(module, "heads", None)
    return inner // heads if isinstance(inner, int) and isinstance(heads, int) and heads else None


def route_pipeline_attention(denoisers: Sequence[torch.nn.Module], others: Sequence[torch.nn.Module],
                             options: LoadOptions) -> AttentionRoute:
    """Route every routable attention module of ``denoisers`` (counted) and ``others`` (VAEs: routed where
    plain, not counted) to omnicore's selection; nothing when ``options.attention`` is ``None``."""
    if options.attention is None:
        return AttentionRoute()
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    dispatch = RoutedDispatch(options, dispatch_attention_fn)
    made: dict[type, type] = {}
    routed, unrouted = 0, []
    for model in others:
        route_diffusers_attention(model, options)
    for model in denoisers:
        routed += route_diffusers_attention(model, options)
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if processor is None or not callable(processor) or isinstance(module, torch.nn.ModuleList):
                continue
            if getattr(type(processor), "omnicore_routed", False) or type(processor).__name__ == "SelectedAttention":
                continue
            if not _dispatching(processor):
                unrouted.append(type(processor).__name__)
                continue
            processor.__class__ = _routed_class(type(processor), dispatch, made)
            parameter = next(module.parameters(), None)
            head_dim = _head_dim(module)
            if parameter is not None and head_dim is not None:  # select at load: the engine counts selections
                dispatch.select(parameter.dtype, head_dim)
            routed += 1
    return AttentionRoute(routed=routed, unrouted=tuple(sorted(set(unrouted))))
