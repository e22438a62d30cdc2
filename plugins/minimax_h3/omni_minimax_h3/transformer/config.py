"""``MiniMaxH3TransformerConfig``: the ``transformer/config.json`` of a MiniMax-H3 DiT.

Field names and defaults are exactly the keyword arguments of diffusers' ``MiniMaxH3Transformer3DModel``
(``register_to_config``), defaults = the released model, so a diffusers ``config.json`` round-trips through
:meth:`MiniMaxH3TransformerConfig.from_dict` / :meth:`to_dict`. The official partition layout names the
same hyper-parameters differently (``token_refiner_num_layers``, ``ffn_hidden_size``, ``latents_dim``, ...);
:meth:`from_dict` accepts those names too and checks the derived ones (``adaln_out_features`` = 18·H,
``final_adaln_out_features`` = 2·H). Keys starting with ``_`` (``_class_name``, ``_diffusers_version``) and a few
bookkeeping keys are ignored; any other unknown key is an error naming it. Torch-free on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from omnicore.plugin import ConfigError

#: Rows of the per-block AdaLN table per distinct timestep: 0 video, 1 text, 2 audio.
MODALITY_NUM = 3
#: Modulation vectors per (timestep, modality) row of a block: shift/scale/gate for attention, then for the MLP.
BLOCK_EXPAND = 6

#: Official (native) config key -> diffusers key.
NATIVE_ALIASES: dict[str, str] = {
    "token_refiner_num_layers": "num_refiner_layers",
    "ffn_hidden_size": "ffn_dim",
    "latents_dim": "in_channels",
    "audio_latents_dim": "audio_in_channels",
    "timestep_input_dim": "freq_dim",
    "time_embed_hidden_size": "time_embed_hidden_dim",
    "rope_inv_freq_len": "rope_freq_dim",
}
#: Keys that carry no hyper-parameter of ours (checked where they are derived, ignored otherwise).
_IGNORED = frozenset({"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
                      "adaln_out_features", "final_adaln_out_features"})


def _int_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"expected a list of ints, got {value!r}")
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class MiniMaxH3TransformerConfig:
    """Hyper-parameters of the MiniMax-H3 DiT (keys exactly as diffusers' ``config.json``)."""

    num_attention_heads: int = attrs.field(default=56, converter=int)
    attention_head_dim: int = attrs.field(default=128, converter=int)
    hidden_size: int = attrs.field(default=5376, converter=int)
    num_layers: int = attrs.field(default=50, converter=int)
    num_refiner_layers: int = attrs.field(default=2, converter=int)
    ffn_dim: int = attrs.field(default=14336, converter=int)
    in_channels: int = attrs.field(default=24, converter=int)
    audio_in_channels: int = attrs.field(default=32, converter=int)
    patch_size: tuple[int, ...] = attrs.field(default=(1, 2, 2), converter=_int_tuple)
    text_dim: int = attrs.field(default=5120, converter=int)
    freq_dim: int = attrs.field(default=256, converter=int)
    time_embed_hidden_dim: int = attrs.field(default=5376, converter=int)
    time_embed_dim: int = attrs.field(default=2688, converter=int)
    rope_freq_dim: int = attrs.field(default=16, converter=int)
    rope_theta: float = attrs.field(default=10000.0, converter=float)
    norm_eps: float = attrs.field(default=1e-5, converter=float)
    qk_norm_eps: float = attrs.field(default=1e-5, converter=float)
    final_norm_eps: float = attrs.field(default=1e-5, converter=float)

    def __attrs_post_init__(self) -> None:
        positive = ("num_attention_heads", "attention_head_dim", "hidden_size", "ffn_dim", "in_channels",
                    "audio_in_channels", "text_dim", "freq_dim", "time_embed_hidden_dim", "time_embed_dim",
                    "rope_freq_dim")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("num_layers", "num_refiner_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ConfigError("patch_size", f"must be three positive ints (t, h, w), got {list(self.patch_size)}")
        if self.freq_dim % 2:
            raise ConfigError("freq_dim", f"must be even (cos | sin halves), got {self.freq_dim}")
        if self.rotary_dim > self.attention_head_dim:
            raise ConfigError("rope_freq_dim", f"6 * rope_freq_dim = {self.rotary_dim} exceeds attention_head_dim "
                                               f"{self.attention_head_dim}")
        for name in ("norm_eps", "qk_norm_eps", "final_norm_eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")

    # ------------------------------------------------------------------ derived values
    @property
    def inner_dim(self) -> int:
        """Width of q, k and v (``heads * head_dim``; larger than ``hidden_size`` in the release)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rotary_dim(self) -> int:
        """Leading head channels rotated by RoPE: three axes of ``rope_freq_dim`` frequencies, doubled."""
        return 6 * self.rope_freq_dim

    @property
    def video_patch_dim(self) -> int:
        """Width of one packed video row (``in_channels * prod(patch_size)``; 96 in the release)."""
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MiniMaxH3TransformerConfig:
        """From a diffusers or an official ``config.json`` (native aliases accepted, unknown keys rejected)."""
        fields = {f.name for f in attrs.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key.startswith("_") or key in _IGNORED:
                continue
            name = NATIVE_ALIASES.get(key, key)
            if name not in fields:
                raise ConfigError(f"transformer.config.{key}", "unknown MiniMax-H3 transformer config key")
            if name in values and values[name] != value:
                raise ConfigError(f"transformer.config.{key}", f"conflicts with an alias of {name!r}")
            values[name] = value
        try:
            config = cls(**values)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError("transformer.config", str(exc)) from None
        h = config.hidden_size
        for key, want in (("adaln_out_features", MODALITY_NUM * BLOCK_EXPAND * h), ("final_adaln_out_features", 2 * h)):
            if key in raw and int(raw[key]) != want:
                raise ConfigError(f"transformer.config.{key}", f"must be {want} for hidden_size {h}, got {raw[key]}")
        return config

    def to_dict(self) -> dict[str, Any]:
        """The diffusers ``config.json`` keys (``patch_size`` as a list)."""
        out = attrs.asdict(self)
        out["patch_size"] = list(self.patch_size)
        return out

    @classmethod
    def tiny(cls, **overrides: Any) -> MiniMaxH3TransformerConfig:
        """The tiny CPU config (rot_dim 24 <= head_dim 32)."""
        base: dict[str, Any] = {
            "num_layers": 2, "num_refiner_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
            "attention_head_dim": 32, "ffn_dim": 128, "in_channels": 24, "audio_in_channels": 32,
            "patch_size": (1, 2, 2), "text_dim": 32, "freq_dim": 32, "time_embed_hidden_dim": 64, "time_embed_dim": 32,
            "rope_freq_dim": 4}
        base.update(overrides)
        return cls(**base)
