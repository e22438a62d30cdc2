"""``LingBotTransformerConfig``: the ``transformer/config.json`` of a LingBot-Video checkpoint.

Field names and defaults mirror the diffusers ``register_to_config`` kwargs exactly so a shipped config round-trips;
defaults are the Dense 1.3B values. Torch-free on purpose.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
from omnicore.plugin import ConfigError

logger = logging.getLogger("omni_lingbot")

_SCORE_FUNCS = ("sigmoid", "softmax")


def _int_triple(value: Any) -> tuple[int, int, int]:
    """``patch_size``: exactly three ints (pf, ph, pw)."""
    items = _int_tuple(value)
    if len(items) != 3:
        raise ConfigError("patch_size", f"must be 3 positive ints (pf, ph, pw), got {items}")
    return items[0], items[1], items[2]


def _int_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"expected a list of ints, got {value!r}")
    return tuple(int(v) for v in value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


@attrs.frozen(kw_only=True)
class LingBotTransformerConfig:
    """Hyper-parameters of ``LingBotVideoTransformer3DModel`` (keys exactly as in ``config.json``)."""

    patch_size: tuple[int, int, int] = attrs.field(default=(1, 2, 2), converter=_int_triple)
    in_channels: int = attrs.field(default=16, converter=int)
    out_channels: int = attrs.field(default=16, converter=int)
    hidden_size: int = attrs.field(default=2048, converter=int)
    num_attention_heads: int = attrs.field(default=16, converter=int)
    depth: int = attrs.field(default=24, converter=int)
    intermediate_size: int = attrs.field(default=6144, converter=int)
    text_dim: int = attrs.field(default=2560, converter=int)
    freq_dim: int = attrs.field(default=256, converter=int)
    norm_eps: float = attrs.field(default=1e-6, converter=float)
    rope_theta: float = attrs.field(default=256.0, converter=float)
    axes_dims: tuple[int, ...] = attrs.field(default=(32, 48, 48), converter=_int_tuple)
    axes_lens: tuple[int, ...] = attrs.field(default=(8192, 1024, 1024), converter=_int_tuple)
    qkv_bias: bool = attrs.field(default=False, converter=bool)
    out_bias: bool = attrs.field(default=True, converter=bool)
    patch_embed_bias: bool = attrs.field(default=True, converter=bool)
    timestep_mlp_bias: bool = attrs.field(default=True, converter=bool)
    num_experts: int = attrs.field(default=0, converter=int)
    num_experts_per_tok: int = attrs.field(default=8, converter=int)
    moe_intermediate_size: int = attrs.field(default=512, converter=int)
    decoder_sparse_step: int = attrs.field(default=1, converter=int)
    mlp_only_layers: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    n_shared_experts: int | None = attrs.field(default=None, converter=_opt_int)
    score_func: str = attrs.field(default="sigmoid", converter=str)
    norm_topk_prob: bool = attrs.field(default=True, converter=bool)
    n_group: int | None = attrs.field(default=None, converter=_opt_int)
    topk_group: int | None = attrs.field(default=None, converter=_opt_int)
    routed_scaling_factor: float = attrs.field(default=1.0, converter=float)

    def __attrs_post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ derived values
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_volume(self) -> int:
        pf, ph, pw = self.patch_size
        return pf * ph * pw

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` uses the MoE FFN."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LingBotTransformerConfig:
        """Build from a parsed ``config.json``; ``_``-prefixed metadata keys are ignored, and so is any other key
        this model does not know, with a warning naming it: a checkpoint written by a newer release (or a diffusers
        config carrying extra bookkeeping) must still load, as it does in the reference and in diffusers."""
        known = {f.name for f in attrs.fields(cls)}
        kwargs = {k: v for k, v in data.items() if not k.startswith("_")}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            logger.warning("LingBot transformer config: ignoring unknown key(s) %s (not used by this model)",
                           ", ".join(unknown))
            kwargs = {k: v for k, v in kwargs.items() if k in known}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError("transformer config", str(exc)) from exc

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists) with exactly the config.json keys."""
        out: dict[str, Any] = {}
        for f in attrs.fields(type(self)):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ConfigError(name, rule)

        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            fail("patch_size", f"must be 3 positive ints (pf, ph, pw), got {self.patch_size}")
        for name in ("in_channels", "out_channels", "hidden_size", "num_attention_heads", "intermediate_size",
                     "text_dim", "freq_dim"):
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.depth < 0:
            fail("depth", f"must be >= 0, got {self.depth}")
        if self.freq_dim % 2:
            fail("freq_dim", f"must be even, got {self.freq_dim}")
        if self.hidden_size % self.num_attention_heads:
            fail("num_attention_heads", f"must divide hidden_size {self.hidden_size}, got {self.num_attention_heads}")
        if self.norm_eps <= 0:
            fail("norm_eps", f"must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            fail("rope_theta", f"must be > 0, got {self.rope_theta}")
        if len(self.axes_dims) != 3 or len(self.axes_lens) != 3:
            fail("axes_dims", f"axes_dims and axes_lens must have 3 entries (t, h, w), got {self.axes_dims} "
                              f"and {self.axes_lens}")
        if any(d <= 0 or d % 2 for d in self.axes_dims):
            fail("axes_dims", f"every axis dim must be a positive even int, got {self.axes_dims}")
        if any(n < 1 for n in self.axes_lens):
            fail("axes_lens", f"must be positive, got {self.axes_lens}")
        if sum(self.axes_dims) != self.head_dim:
            fail("axes_dims", f"sum(axes_dims)={sum(self.axes_dims)} must equal head_dim="
                              f"hidden_size/num_attention_heads={self.head_dim}")
        if self.score_func not in _SCORE_FUNCS:
            fail("score_func", f"must be one of {_SCORE_FUNCS}, got {self.score_func!r}")
        if self.decoder_sparse_step < 1:
            fail("decoder_sparse_step", f"must be >= 1, got {self.decoder_sparse_step}")
        if self.num_experts < 0:
            fail("num_experts", f"must be >= 0, got {self.num_experts}")
        if self.num_experts == 0:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            fail("num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}], got "
                                        f"{self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            fail("moe_intermediate_size", f"must be >= 1, got {self.moe_intermediate_size}")
        if self.n_shared_experts is not None and self.n_shared_experts < 0:
            fail("n_shared_experts", f"must be >= 0 or null, got {self.n_shared_experts}")
        if self.routed_scaling_factor <= 0:
            fail("routed_scaling_factor", f"must be > 0, got {self.routed_scaling_factor}")
        if (self.n_group is None) != (self.topk_group is None):
            fail("topk_group", "n_group and topk_group must be both set or both null")
        if self.n_group is not None and self.topk_group is not None:
            if self.n_group < 1 or self.num_experts % self.n_group:
                fail("n_group", f"must be >= 1 and divide num_experts={self.num_experts}, got {self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                fail("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
            if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
                fail("topk_group", f"topk_group={self.topk_group} groups of {self.num_experts // self.n_group} "
                                   f"experts cannot hold num_experts_per_tok={self.num_experts_per_tok}")
