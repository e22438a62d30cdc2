"""Checkpoint configuration: ``config.json`` (language model, nested ``vae``/``vit``/``vit_processor``/
``vit_aligner``) and ``generation_config.json`` of the single HunyuanImage-3 repository.

Only the fields the diffusion path uses are typed; everything else is kept in ``raw`` so a config round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

MODEL_TYPE = "Hunyuan"


class ConfigFileError(ValueError):
    """A config file is missing, unreadable or inconsistent (names the file and the field)."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise ConfigFileError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _uniform(data: dict[str, Any], key: str, default: Any) -> Any:
    """A per-layer list (HunYuan MoE configs allow them) must hold one value for every layer here."""
    value = data.get(key, default)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ConfigFileError(f"config.json: {key} varies across layers ({value}); only uniform values "
                                  "are supported")
        return value[0]
    return value


def _int(data: dict[str, Any], key: str, default: Any = None) -> int:
    value = _uniform(data, key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise ConfigFileError(f"config.json: {key} must be an integer, got {value!r}")
    return value


@attrs.frozen
class HunyuanConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    attention_head_dim: int
    num_experts: int
    moe_topk: int
    num_shared_expert: int
    use_mixed_mlp_moe: bool
    moe_layer_num_skipped: int
    rms_norm_eps: float
    rope_theta: float
    use_qk_norm: bool
    patch_size: int
    patch_embed_hidden_dim: int
    image_base_size: int
    vae_downsample_factor: tuple[int, int]
    cfg_distilled: bool
    use_meanflow: bool
    vae: dict[str, Any]
    vit: dict[str, Any] | None
    vit_processor: dict[str, Any] | None
    vit_aligner: dict[str, Any] | None
    raw: dict[str, Any] = attrs.field(eq=False, repr=False)

    @property
    def latent_channels(self) -> int:
        return int(self.vae["latent_channels"])

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_vision(self) -> bool:
        return self.vit is not None and self.vit_aligner is not None

    def layer_is_moe(self, index: int) -> bool:
        return self.num_experts > 1 and index >= self.moe_layer_num_skipped

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HunyuanConfig:
        if "vae" not in data or not isinstance(data["vae"], dict):
            raise ConfigFileError("config.json: the nested 'vae' config is missing")
        heads, kv = _int(data, "num_attention_heads"), _int(data, "num_key_value_heads")
        if heads % kv:
            raise ConfigFileError(f"config.json: num_attention_heads {heads} is not a multiple of "
                                  f"num_key_value_heads {kv}")
        hidden = _int(data, "hidden_size")
        head_dim = data.get("attention_head_dim") or data.get("head_dim") or hidden // heads
        if data.get("img_proj_type", "unet") != "unet":
            raise ConfigFileError(f"config.json: img_proj_type {data.get('img_proj_type')!r} is not supported "
                                  "(only 'unet')")
        if int(data.get("patch_size", 1)) != 1:
            raise ConfigFileError(f"config.json: patch_size {data.get('patch_size')} is not supported (only 1)")
        factor = data.get("vae_downsample_factor", [16, 16])
        intermediate = _int(data, "intermediate_size")
        vit = data.get("vit")
        return cls(
            vocab_size=_int(data, "vocab_size"), hidden_size=hidden, intermediate_size=intermediate,
            moe_intermediate_size=int(_uniform(data, "moe_intermediate_size", None) or intermediate),
            num_hidden_layers=_int(data, "num_hidden_layers"), num_attention_heads=heads,
            num_key_value_heads=kv, attention_head_dim=int(head_dim),
            num_experts=_int(data, "num_experts", 1), moe_topk=_int(data, "moe_topk", 1),
            num_shared_expert=_int(data, "num_shared_expert", 0),
            use_mixed_mlp_moe=bool(data.get("use_mixed_mlp_moe", False)),
            moe_layer_num_skipped=int(data.get("moe_layer_num_skipped", 0)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)), rope_theta=float(data.get("rope_theta", 10000.0)),
            use_qk_norm=bool(data.get("use_qk_norm", True)), patch_size=1,
            patch_embed_hidden_dim=int(data.get("patch_embed_hidden_dim", 1024)),
            image_base_size=int(data.get("image_base_size", 1024)),
            vae_downsample_factor=(int(factor[0]), int(factor[1])),
            cfg_distilled=bool(data.get("cfg_distilled", False)), use_meanflow=bool(data.get("use_meanflow", False)),
            vae=dict(data["vae"]), vit=dict(vit) if isinstance(vit, dict) else None,
            vit_processor=data.get("vit_processor"), vit_aligner=data.get("vit_aligner"), raw=dict(data),
        )

    @classmethod
    def from_file(cls, path: Path) -> HunyuanConfig:
        return cls.from_dict(read_json(path))


@attrs.frozen
class GenerationConfig:
    """``generation_config.json``: the diffusion defaults and the prompt template."""

    diff_infer_steps: int = 50
    diff_guidance_scale: float | None = None
    flow_shift: float = 3.0
    sequence_template: str = "pretrain"
    bot_task: str = "auto"
    use_system_prompt: str | None = None
    drop_think: bool = False
    max_length: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationConfig:
        template = data.get("sequence_template", "pretrain")
        if template not in ("pretrain", "instruct"):
            raise ConfigFileError(f"generation_config.json: sequence_template must be 'pretrain' or 'instruct', "
                                  f"got {template!r}")
        guidance = data.get("diff_guidance_scale")
        return cls(diff_infer_steps=int(data.get("diff_infer_steps", 50)),
                   diff_guidance_scale=None if guidance is None else float(guidance),
                   flow_shift=float(data.get("flow_shift", 3.0)), sequence_template=template,
                   bot_task=str(data.get("bot_task", "auto")), use_system_prompt=data.get("use_system_prompt"),
                   drop_think=bool(data.get("drop_think", False)), max_length=data.get("max_length"))

    @classmethod
    def from_file(cls, path: Path) -> GenerationConfig:
        return cls.from_dict(read_json(path)) if Path(path).is_file() else cls()
