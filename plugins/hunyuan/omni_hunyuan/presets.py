"""``tiny:hunyuan-image3``: a deterministic random-weight checkpoint in the release layout.

Writes ``config.json`` (architectures, nested ``vae``/``vit``/``vit_processor``/``vit_aligner``),
``generation_config.json``, a byte-level tokenizer whose special tokens (``<boi>``, ``<img>``, ``<cfg>``,
``<timestep>``, ``<img_size_256>``, ``<img_ratio_0..32>`` ...) are remapped into a 512-entry vocabulary, and
release-named safetensors shards with grouped ``qkv_proj`` and ``[up | gate]`` fused MLPs. The same seed gives
the same weights; the result loads through the normal loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omnicore.plugin import byte_level_tokenizer, init_visible_weights

from .buckets import ResolutionGroup
from .config import MODEL_TYPE
from .detect import ARCHITECTURE
from .tokenizer import SPECIAL_TOKENS

SEED = 20251001
BASE_SIZE = 256

TINY_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [32, 32, 32, 32, 32],
    "layers_per_block": 1, "ffactor_spatial": 16, "ffactor_temporal": 4, "sample_size": 256, "sample_tsize": 4,
    "scaling_factor": 1.0, "shift_factor": 0.0, "downsample_match_channel": True, "upsample_match_channel": True,
}
TINY_VIT: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_channels": 3, "num_patches": 16, "patch_size": 16, "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh", "attention_dropout": 0.0,
}
TINY_VIT_PROCESSOR: dict[str, Any] = {
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": 16, "max_num_patches": 16,
    "image_processor_type": "Siglip2ImageProcessorFast",
}


def tiny_config(vocab_size: int = 512, base_size: int = BASE_SIZE) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": vocab_size, "hidden_size": 64,
        "intermediate_size": 32, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attention_head_dim": 16, "num_experts": 4, "moe_topk": 2, "num_shared_expert": 1,
        "use_mixed_mlp_moe": True, "norm_topk_prob": True, "moe_layer_num_skipped": 0, "routed_scaling_factor": 1.0,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": {"type": "custom"},
        "use_qk_norm": True, "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 22800,
        "img_proj_type": "unet", "patch_size": 1, "patch_embed_hidden_dim": 32, "image_base_size": base_size,
        "vae_downsample_factor": [16, 16], "tie_word_embeddings": False, "cfg_distilled": False,
        "use_meanflow": False, "vae": dict(TINY_VAE), "vit": dict(TINY_VIT), "vit_processor": dict(TINY_VIT_PROCESSOR),
        "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2},
    }


GENERATION_CONFIG: dict[str, Any] = {
    "diff_infer_steps": 4, "diff_guidance_scale": 5.0, "flow_shift": 3.0, "sequence_template": "instruct",
    "bot_task": "image", "use_system_prompt": None, "drop_think": False, "max_length": 22800,
}


def tokenizer_tokens(base_size: int = BASE_SIZE) -> list[str]:
    ratios = [f"<img_ratio_{i}>" for i in range(len(ResolutionGroup(base_size)))]
    return list(SPECIAL_TOKENS.values()) + [f"<img_size_{base_size}>"] + ratios


def build_tokenizer(root: Path, base_size: int = BASE_SIZE) -> int:
    """A byte-level BPE without merges (any text encodes) plus the Hunyuan special tokens; returns its size."""
    tok = byte_level_tokenizer(root, tokenizer_tokens(base_size), bos_token=SPECIAL_TOKENS["bos"],
                               eos_token=SPECIAL_TOKENS["eos"], pad_token=SPECIAL_TOKENS["pad"],
                               model_max_length=22800)
    return tok.vocab_size


def _fan_in(name: str, param: torch.Tensor) -> int:
    """Expert weights are stored [experts, out, in]: their fan-in is the last dim."""
    return int(param.shape[-1]) if name.endswith(("w_gate", "w_up", "w_down")) else param[0].numel()


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (zero-initialised convs would hide bugs): matrices and kernels
    ~ N(0, 1/fan_in), norm weights (GroupNorm, LayerNorm, RMSNorm modules) ~ 1 + N(0, 0.1²), everything else
    ~ N(0, 0.1²)."""
    from .modules import RMSNorm

    norms = {f"{n}.weight" for n, m in module.named_modules()
             if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm, RMSNorm))}
    init_visible_weights(module, seed, fan_in=_fan_in, is_norm_weight=lambda name, param: name in norms)


def build_tiny(target_dir: str | Path, seed: int = SEED, base_size: int = BASE_SIZE,
               overrides: dict[str, Any] | None = None) -> Path:
    """Write the tiny repository; ``base_size`` (default 256) sets the bucket base and the ``<img_size_B>`` token
    (tests use 64 for 64x64 images, which only the square bucket supports); ``overrides`` replaces top-level
    ``config.json`` fields (benchmarks use it for a mid-size model)."""
    from .config import HunyuanConfig
    from .loader import save_checkpoint
    from .model import HunyuanImage3

    root = Path(target_dir)
    root.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(root, base_size)
    config = {**tiny_config(base_size=base_size), **(overrides or {})}
    if vocab > config["vocab_size"]:  # pragma: no cover - the tiny tokenizer is ~310 entries
        raise ValueError(f"tokenizer has {vocab} entries, more than vocab_size {config['vocab_size']}")
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (root / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2, sort_keys=True) + "\n")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HunyuanImage3(HunyuanConfig.from_dict(config))
        randomize_(model, seed)
    save_checkpoint(model, root, shards=2)
    return root


def build_tiny_hunyuan_image3(target_dir: str | Path) -> Path:
    """``tiny:hunyuan-image3``: hidden 64, 2 MoE layers (4 experts, top-2, shared MLP), 32-channel VAE,
    one-layer SigLIP2 vision tower; instruct template, 4 steps by default."""
    return build_tiny(target_dir)
