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
from .detect import ARCHITECTURE
from .tokenizer import SPECIAL_TOKENS
from .transformer.config import MODEL_TYPE

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
    from .transformer.blocks import RMSNorm

    norms = {f"{n}.weight" for n, m in module.named_modules()
             if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm, RMSNorm))}
    init_visible_weights(module, seed, fan_in=_fan_in, is_norm_weight=lambda name, param: name in norms)


def build_tiny(target_dir: str | Path, seed: int = SEED, base_size: int = BASE_SIZE,
               overrides: dict[str, Any] | None = None) -> Path:
    """Write the tiny repository; ``base_size`` (default 256) sets the bucket base and the ``<img_size_B>`` token
    (tests use 64 for 64x64 images, which only the square bucket supports); ``overrides`` replaces top-level
    ``config.json`` fields (benchmarks use it for a mid-size model)."""
    from .loader import save_checkpoint
    from .transformer.config import HunyuanConfig
    from .transformer.model import HunyuanImage3

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


# ---------------------------------------------------------------------------------------------- real-size configs
# ``omnicore plan real:hunyuan-image3`` reads this: the release's config.json without weights. The language model
# is the release config (80,413,470,720 parameters under ``model.``); the nested VAE (32 latent
# channels, an uncertain value), SigLIP2 tower and aligner values are ours (so400m-class tower) and are not
# checked against the checkpoint.

REAL_PRESETS: dict[str, str] = {"real:hunyuan-image3": "omni_hunyuan.presets:build_real_hunyuan_image3"}
REAL_OVERRIDES: dict[str, Any] = {
    "vocab_size": 133120, "hidden_size": 4096, "intermediate_size": 3072, "moe_intermediate_size": 3072,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128,
    "num_experts": 64, "moe_topk": 8, "num_shared_expert": 1, "patch_embed_hidden_dim": 1024,
    "image_base_size": 1024,
}
REAL_PROVENANCE = {
    "language_model": "release (80,413,470,720 parameters)",
    "vae": "latent 32 (uncertain), block_out_channels 128..1024 x 2 layers: unverified",
    "vision": "SigLIP2 so400m-class tower (1152 hidden, 27 layers) + mlp_gelu aligner: unverified",
}


def build_real_hunyuan_image3(target_dir: str | Path) -> Path:
    """``config.json`` + ``generation_config.json`` of the release (no weights, no tokenizer)."""
    root = Path(target_dir)
    root.mkdir(parents=True, exist_ok=True)
    config = {**tiny_config(vocab_size=REAL_OVERRIDES["vocab_size"], base_size=1024), **REAL_OVERRIDES}
    config["vae"] = {**TINY_VAE, "latent_channels": 32, "block_out_channels": [128, 256, 512, 1024, 1024],
                     "layers_per_block": 2, "sample_size": 1024, "scaling_factor": 1.0}
    config["vit"] = {**TINY_VIT, "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                     "num_attention_heads": 16, "num_patches": 1024}
    config["vit_processor"] = {**TINY_VIT_PROCESSOR, "max_num_patches": 1024}
    config["vit_aligner"] = {"projector_type": "mlp_gelu", "input_dim": 1152, "n_embed": 4096, "depth": 2}
    config["_omnicore_plan"] = {"weights": False, "provenance": REAL_PROVENANCE}
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {**GENERATION_CONFIG, "diff_infer_steps": 50, "diff_guidance_scale": 2.5}
    (root / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return root


# ---------------------------------------------------------------------------------------------- the planner's view
#: The language model's attention and MLP linears and its stacked expert weights (never the router, norms,
#: embeddings, the timestep embedders, patch_embed / final_layer, the VAE or the vision tower).
QUANTIZABLE = {
    "language_model": ("layers.*.self_attn.qkv_proj", "layers.*.self_attn.o_proj", "layers.*.mlp.*_proj",
                       "layers.*.mlp.shared_mlp.*_proj", "layers.*.mlp.experts.w_*"),
}
#: Top-level modules of HunyuanImage3 outside the language model, the VAE and the vision tower.
HEADS = ("lm_head", "timestep_emb", "time_embed", "time_embed_2", "guidance_emb", "timestep_r_emb", "patch_embed",
         "final_layer")


def plan_model(root: str | Path, dtype: torch.dtype) -> dict[str, Any]:
    """The model as :meth:`HunyuanImage3Pipeline.from_pretrained` holds it (everything in ``dtype``, the VAE in
    float32), built on the meta device and split into the language model, its heads, the VAE and the vision
    tower."""
    from .transformer.config import HunyuanConfig
    from .transformer.model import HunyuanImage3

    config = HunyuanConfig.from_file(Path(root) / "config.json")
    with torch.device("meta"):
        model = HunyuanImage3(config)
    model.to(dtype=dtype)
    model.vae.float()
    components: dict[str, torch.nn.Module] = {
        "language_model": model.model,
        "heads": torch.nn.ModuleList([getattr(model, n) for n in HEADS if hasattr(model, n)]),
        "vae": model.vae,
    }
    if hasattr(model, "vision_model"):
        components["vision"] = torch.nn.ModuleList([model.vision_model, model.vision_aligner])
    ffn = (config.moe_topk + config.num_shared_expert) * config.moe_intermediate_size
    raw = json.loads((Path(root) / "config.json").read_text())

    def shard(tp: int, ep: int) -> dict[str, torch.nn.Module]:
        """Rank 0's language model under ``(tp, ep)``: the load's own :func:`.transformer.model.build_sharded`
        narrowing (``shard_module`` with the TP plan, ``StackedExperts.keep_experts``) on the meta device, cast as
        the load casts (a degree the plan or the expert count refuses raises ConfigError)."""
        from .transformer.model import build_sharded_meta

        sharded = build_sharded_meta(config, None, (0, tp) if tp > 1 else None, (0, ep) if ep > 1 else None)
        return {"language_model": sharded.model.to(dtype=dtype)}

    experts = ({"experts": {"count": config.num_experts, "modules": {"language_model": ("layers.*.mlp.experts",)}}}
               if config.num_experts > 1 else {})
    return {
        **experts, "shard": shard,
        "components": components, "dit": "language_model",
        "offload_modes": [],  # the pipeline declares neither offload_modules nor a block loop
        "shape": {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "heads": config.num_attention_heads, "head_dim": config.attention_head_dim, "ffn": ffn,
                  "block_prefix": "layers."},
        "quantizable": QUANTIZABLE, "cfg_capable": not config.cfg_distilled,
        "provenance": (raw.get("_omnicore_plan") or {}).get("provenance"),
    }


def plan_request(root: str | Path, request: dict[str, Any]) -> dict[str, Any]:
    """Rows of one diffusion forward: the prompt template (estimated 320 tokens: system prompt and roles, or the
    prompt's UTF-8 bytes + 64 when a prompt is given) + ``<timestep>`` + the bucket's (H/16)·(W/16) image
    tokens; two batched rows with CFG. The prompt K/V of the first step is kept for later steps (counted as a
    cache)."""
    from omnicore.plugin import SamplingParams, check_extra

    from .buckets import ResolutionGroup
    from .plugin import DEFAULTS, MODEL_SPEC
    from .request_rules import resolve_guidance, snap_size
    from .transformer.config import HunyuanConfig

    config = HunyuanConfig.from_file(Path(root) / "config.json")
    SamplingParams(**{k: v for k, v in request.items() if k not in ("extra", "prompt")})  # names a bad field
    check_extra(dict(request.get("extra") or {}), MODEL_SPEC)
    height = int(request.get("height") or DEFAULTS.height)
    width = int(request.get("width") or DEFAULTS.width)
    bucket = snap_size(height, width, ResolutionGroup(config.image_base_size))
    factor = config.vae_downsample_factor[0] * config.patch_size
    image = (bucket.height // factor) * (bucket.width // factor)
    prompt = request.get("prompt")
    text = (min(len(str(prompt).encode()), 1024) + 64) if prompt else 320
    guidance, branches = resolve_guidance(request.get("guidance_scale"), config.cfg_distilled)
    steps = int(request.get("num_inference_steps") or DEFAULTS.num_inference_steps)
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * config.attention_head_dim * text * branches
    return {"tokens": text + 1 + image, "cfg_branches": branches, "steps": steps, "text_tokens": text,
            "cache_elements": {"prompt_kv": kv},
            "resolved": {"height": bucket.height, "width": bucket.width, "image_tokens": image,
                         "text_tokens": text, "guidance_scale": guidance}}


def quantization_targets(pipeline: Any) -> dict[str, tuple[torch.nn.Module, tuple[str, ...]]]:
    """The language model (attention and MLP linears, stacked experts) for ``--quantization``."""
    return {"language_model": (pipeline.model.model, QUANTIZABLE["language_model"])}
