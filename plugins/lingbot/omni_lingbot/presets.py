"""Tiny random-weight LingBot checkpoints in the real repository layout.

``build_tiny_lingbot(dir)`` / ``build_tiny_lingbot_moe(dir)`` write model_index.json, transformer/ (config +
safetensors), text_encoder/ (a tiny Qwen3-VL saved with ``save_pretrained``), processor/ (a byte-level tokenizer
holding the Qwen special tokens, and the image processor config), vae/ (a tiny AutoencoderKLWan) and
scheduler/; the MoE preset also writes refiner/ (a second tiny DiT in the transformer's format). The same seed
always gives the same bytes' worth of weights, and the result loads through the normal loader — the presets are
end-to-end fixtures, not mocks.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, cast

import torch
from omnicore.plugin import build_tiny_qwen3_vl, init_visible_weights

from .detect import PIPELINE_CLASS, TRANSFORMER_CLASS
from .loader import save_transformer

SEED = 20240607

TINY_DIT: dict[str, Any] = {
    "patch_size": [1, 2, 2], "in_channels": 4, "out_channels": 4, "hidden_size": 64, "num_attention_heads": 2,
    "depth": 2, "intermediate_size": 128, "text_dim": 32, "freq_dim": 32, "axes_dims": [8, 12, 12],
    "axes_lens": [64, 64, 64],
}
TINY_MOE: dict[str, Any] = {
    **TINY_DIT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "mlp_only_layers": [0],
}
#: base_dim 16; 8 keeps the same structure (8x spatial, 4x temporal) and decodes a
#: 9-frame 320x192 clip ~2.5x faster on CPU.
TINY_VAE: dict[str, Any] = {
    "base_dim": 8, "z_dim": 4, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
    "temperal_downsample": [False, True, True], "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4,
}
SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "FlowUniPCMultistepScheduler", "num_train_timesteps": 1000, "solver_order": 2,
    "prediction_type": "flow_prediction", "shift": 1.0, "use_dynamic_shifting": False, "predict_x0": True,
    "solver_type": "bh2", "lower_order_final": True, "final_sigmas_type": "zero",
}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _last_dim_fan_in(name: str, param: torch.Tensor) -> int:
    return int(param.shape[-1])


def _owner_is_norm(name: str, param: torch.Tensor) -> bool:
    """A 1-D ``weight`` of a module whose own name mentions ``norm``."""
    owner, _, leaf = name.rpartition(".")
    return param.dim() == 1 and leaf == "weight" and "norm" in owner.rpartition(".")[2]


def _is_modulation_table(name: str, param: torch.Tensor) -> bool:
    return "scale_shift_table" in name


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Give every tensor non-trivial values (so zero-initialised gates or projections do not hide bugs):
    matrices ~ N(0, 1/fan_in) (fan-in = last dim), norm weights ~ 1 + N(0, 0.1²), everything else (the
    modulation tables included) ~ N(0, 0.1²)."""
    init_visible_weights(module, seed, fan_in=_last_dim_fan_in, is_norm_weight=_owner_is_norm,
                         is_plain=_is_modulation_table)


def build_vae(vae_dir: Path, seed: int) -> None:
    """A tiny Wan VAE whose reconstructions depend on the image: with PyTorch's default init the signal fades
    through the stack and every image decodes to nearly the same grey, so the weights get a sqrt(3) gain and the
    posterior is made sharp (log-variance -12) so the mean, not the sampling noise, carries the image."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae: Any = AutoencoderKLWan(**TINY_VAE)  # diffusers' model mixins are invisible to mypy
    z = TINY_VAE["z_dim"]
    with torch.no_grad():
        for param in vae.parameters():
            if param.dim() >= 2:
                param.mul_(math.sqrt(3.0))
        vae.quant_conv.weight[z:] = 0.0
        vae.quant_conv.bias[z:] = -12.0
    vae.save_pretrained(str(vae_dir))


def build_transformer(transformer_dir: Path, config: dict[str, Any], seed: int) -> None:
    from .transformer.config import LingBotTransformerConfig
    from .transformer.model import LingBotVideoTransformer3DModel

    torch.manual_seed(seed)
    model = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(config))
    randomize_(model, seed)
    save_transformer(model, transformer_dir)


def build_tiny(target_dir: str | Path, dit_config: dict[str, Any], seed: int = SEED,
               refiner_config: dict[str, Any] | None = None) -> Path:
    """Write a complete tiny repository to ``target_dir`` (with ``refiner/`` when ``refiner_config`` is given)."""
    root = Path(target_dir)
    root.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        build_transformer(root / "transformer", dit_config, seed)
        if refiner_config is not None:
            build_transformer(root / "refiner", refiner_config, seed + 3)
        build_tiny_qwen3_vl(root / "text_encoder", root / "processor", seed + 1)  # + tokenizer, image processor
        build_vae(root / "vae", seed + 2)
    _write_json(root / "scheduler" / "scheduler_config.json", SCHEDULER_CONFIG)
    index: dict[str, Any] = {
        "_class_name": PIPELINE_CLASS,
        "_diffusers_version": "0.42.1",
        "transformer": ["omni_lingbot", TRANSFORMER_CLASS],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "scheduler": ["omni_lingbot", "FlowUniPCMultistepScheduler"],
    }
    if refiner_config is not None:
        index["refiner"] = ["omni_lingbot", TRANSFORMER_CLASS]
    _write_json(root / "model_index.json", index)
    return root


def build_tiny_lingbot(target_dir: str | Path) -> Path:
    """``tiny:lingbot``: dense DiT (hidden 64, 2 blocks)."""
    return build_tiny(target_dir, TINY_DIT)


def build_tiny_lingbot_moe(target_dir: str | Path) -> Path:
    """``tiny:lingbot-moe``: block 0 dense, block 1 MoE (4 experts, top-2, grouped, one shared expert), plus a
    ``refiner/`` DiT of the same shape with its own weights (the MoE package's optional refiner stage)."""
    return build_tiny(target_dir, TINY_MOE, refiner_config=TINY_MOE)


# ---------------------------------------------------------------------------------------------- real-size configs
# ``omnicore plan real:lingbot`` / ``real:lingbot-moe`` read these: configs and no weights. The dense DiT is the
# transformer class's defaults; the text encoder is Qwen3-VL-4B's
# published config; the VAE is diffusers'
# Wan2.1 ``AutoencoderKLWan`` defaults. The MoE 30B-A3B DiT's values are NOT published in our references
#: the MoE config below is a same-scale stand-in (about 30B parameters), marked
# unverified everywhere it is shown — replace it with the checkpoint's transformer/config.json when known.

REAL_PRESETS: dict[str, str] = {"real:lingbot": "omni_lingbot.presets:build_real_lingbot",
                                "real:lingbot-moe": "omni_lingbot.presets:build_real_lingbot_moe"}
REAL_TEXT_ENCODER: dict[str, Any] = {
    "text_config": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                    "max_position_embeddings": 262144, "rope_theta": 5000000.0, "tie_word_embeddings": True,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20],
                                     "mrope_interleaved": True}},
    "vision_config": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 2560,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17]},
}
#: UNVERIFIED stand-in for the 30B-A3B MoE DiT (same family of routing fields as the class supports).
REAL_MOE_STANDIN: dict[str, Any] = {
    "hidden_size": 2048, "num_attention_heads": 16, "depth": 48, "intermediate_size": 6144, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "mlp_only_layers": [0], "score_func": "sigmoid",
}
REAL_PROVENANCE: dict[str, dict[str, str]] = {
    "real:lingbot": {"transformer": "class defaults = Dense 1.3B",
                     "text_encoder": "Qwen3-VL-4B published config (dims; unverified)",
                     "vae": "diffusers AutoencoderKLWan defaults = Wan2.1"},
    "real:lingbot-moe": {"transformer": "UNVERIFIED stand-in: the 30B-A3B config is not in our references",
                         "refiner": "UNVERIFIED: same stand-in as the transformer",
                         "text_encoder": "Qwen3-VL-4B published config (unverified)",
                         "vae": "diffusers AutoencoderKLWan defaults = Wan2.1"},
}


def _build_real(root: Path, dit: dict[str, Any], preset: str, refiner: bool) -> Path:
    from transformers import Qwen3VLConfig

    from .transformer.config import LingBotTransformerConfig

    cfg = {"_class_name": TRANSFORMER_CLASS, **LingBotTransformerConfig.from_dict(dit).to_dict()}
    _write_json(root / "transformer" / "config.json", cfg)
    if refiner:
        _write_json(root / "refiner" / "config.json", cfg)
    text = Qwen3VLConfig(**REAL_TEXT_ENCODER, image_token_id=151655, video_token_id=151656,
                         vision_start_token_id=151652, vision_end_token_id=151653)
    _write_json(root / "text_encoder" / "config.json", text.to_dict())
    _write_json(root / "vae" / "config.json", {"_class_name": "AutoencoderKLWan"})
    (root / "processor").mkdir(parents=True, exist_ok=True)
    _write_json(root / "scheduler" / "scheduler_config.json", SCHEDULER_CONFIG)
    _write_json(root / "model_index.json", {"_class_name": PIPELINE_CLASS, "_diffusers_version": "0.42.1",
                                            "transformer": ["omni_lingbot", TRANSFORMER_CLASS],
                                            "_omnicore_plan": {"weights": False,
                                                               "provenance": REAL_PROVENANCE[preset]}})
    return root


def build_real_lingbot(target_dir: str | Path) -> Path:
    """Configs of the Dense 1.3B release, no weights."""
    return _build_real(Path(target_dir), {}, "real:lingbot", refiner=False)


def build_real_lingbot_moe(target_dir: str | Path) -> Path:
    """Configs of a 30B-A3B-sized MoE (an unverified stand-in) with its refiner, no weights."""
    return _build_real(Path(target_dir), REAL_MOE_STANDIN, "real:lingbot-moe", refiner=True)


# ---------------------------------------------------------------------------------------------- the planner's view
QUANTIZABLE = {
    "transformer": ("blocks.*.attn.to_q", "blocks.*.attn.to_k", "blocks.*.attn.to_v", "blocks.*.attn.to_out",
                    "blocks.*.ffn.*_proj", "blocks.*.ffn.shared_experts.*_proj"),
    "refiner": ("blocks.*.attn.to_q", "blocks.*.attn.to_k", "blocks.*.attn.to_v", "blocks.*.attn.to_out",
                "blocks.*.ffn.*_proj", "blocks.*.ffn.shared_experts.*_proj"),
    "text_encoder": ("language_model.layers.*.self_attn.*_proj", "language_model.layers.*.mlp.*_proj"),
}


def plan_model(root: str | Path, dtype: torch.dtype) -> dict[str, Any]:
    """The components as :meth:`LingBotPipeline.from_pretrained` holds them, built on the meta device and cast
    with the loader's policies (the DiT's fp32 modules, the text encoder's ``.model`` in ``dtype``, the VAE in
    float32)."""
    from diffusers import AutoencoderKLWan
    from omnicore.plugin import refuse_library_quantized
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from .loader import PLUGIN, cast_for_inference
    from .transformer.config import LingBotTransformerConfig
    from .transformer.model import LingBotVideoTransformer3DModel

    root = Path(root)
    components: dict[str, torch.nn.Module] = {}
    configs = {}
    for part in ("transformer", "refiner"):
        if (root / part / "config.json").is_file():
            refuse_library_quantized(root / part, plugin=PLUGIN, component=part)  # the loader refuses it too
            configs[part] = LingBotTransformerConfig.from_dict(json.loads((root / part / "config.json").read_text()))
            with torch.device("meta"):
                components[part] = cast_for_inference(LingBotVideoTransformer3DModel(configs[part]), dtype)
    with torch.device("meta"):
        te: Any = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_pretrained(str(root / "text_encoder")))
        components["text_encoder"] = te.model.to(dtype)
        components["vae"] = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(str(root / "vae"))).float()
    cfg = configs["transformer"]
    moe = cfg.num_experts > 0
    ffn = ((cfg.num_experts_per_tok + (cfg.n_shared_experts or 0)) * cfg.moe_intermediate_size if moe
           else cfg.intermediate_size)
    index = json.loads((root / "model_index.json").read_text()) if (root / "model_index.json").is_file() else {}
    moe_parts = {k: v for k, v in components.items() if k in configs and configs[k].num_experts > 0}

    def shard(tp: int, ep: int) -> dict[str, torch.nn.Module]:
        """Rank 0's MoE DiTs under ``ep`` (narrowed on the meta device by ``keep_expert_share``, the method the
        load's ``enable_expert_parallel`` narrows with; the load runs it on the transformer and the refiner)."""
        from omnicore.plugin import ConfigError

        if tp > 1:
            raise ConfigError("parallel", f"tp={tp}: LingBot declares no tensor-parallel plan")
        out: dict[str, torch.nn.Module] = {}
        for name, module in components.items():
            if name in configs and ep > 1:
                narrowed = copy.deepcopy(module)
                cast(Any, narrowed).keep_expert_share(0, ep)  # a dense DiT is refused, as at load
                out[name] = narrowed
        return out

    experts = ({"experts": {"count": cfg.num_experts, "modules": {k: ("blocks.*.ffn.experts",) for k in moe_parts}},
                "shard": shard} if moe else {})
    return {
        **experts,
        "components": components, "dit": "transformer",
        "offload_modules": [k for k in ("transformer", "text_encoder", "refiner") if k in components],
        "shape": {"layers": cfg.depth, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                  "head_dim": cfg.hidden_size // cfg.num_attention_heads, "ffn": ffn, "block_prefix": "blocks."},
        "quantizable": QUANTIZABLE, "cfg_capable": True,
        "text_encoder": "text_encoder",  # what text_encoder_offload=cpu keeps in host memory (whole, unquantized)
        "provenance": (index.get("_omnicore_plan") or {}).get("provenance"),
    }


def plan_request(root: str | Path, request: dict[str, Any]) -> dict[str, Any]:
    """Sequence sizes under LingBot's rules (4n+1 frames, sizes on the 16 grid, video tokens then text). The
    text length is the prompt's UTF-8 byte count capped at 512 when given, else 256 (stated, not measured). CFG
    (guidance > 1) runs two branches; both are counted as one packed batch on an accelerator."""
    from omnicore.plugin import SamplingParams, check_extra

    from .plugin import DEFAULTS, MODEL_SPEC
    from .request_rules import resolve_request

    root = Path(root)
    cfg = json.loads((root / "transformer" / "config.json").read_text())
    fields = {k: v for k, v in request.items() if k not in ("extra", "prompt", "modalities")}
    params = SamplingParams(**fields)
    check_extra(dict(request.get("extra") or {}), MODEL_SPEC)
    modalities = request.get("modalities") or (["image"] if params.num_frames == 1 else ["video"])
    prompt = str(request.get("prompt") or "a plan")
    r = resolve_request(prompt=prompt, negative_prompt=None, modalities=modalities, num_images=0, num_videos=0,
                        num_audios=0, params=params, extra=dict(request.get("extra") or {}), defaults=DEFAULTS,
                        device_type="cuda")
    pt, ph, pw = cfg.get("patch_size", [1, 2, 2])
    latent_t = (r.num_frames - 1) // 4 + 1
    video = (latent_t // pt) * (r.height // 8 // ph) * (r.width // 8 // pw)
    text = min(len(prompt.encode()), 512) if request.get("prompt") else 256
    guidance = DEFAULTS.guidance_scale if params.guidance_scale is None else params.guidance_scale
    steps = params.num_inference_steps or DEFAULTS.num_inference_steps
    return {"tokens": (video + text) * params.num_outputs, "cfg_branches": 2 if guidance > 1 else 1,
            "steps": steps, "text_tokens": text,
            "resolved": {"mode": r.mode, "height": r.height, "width": r.width, "num_frames": r.num_frames,
                         "latent_frames": latent_t, "video_tokens": video, "text_tokens": text,
                         "guidance_scale": guidance}}


def quantization_targets(pipeline: Any) -> dict[str, tuple[torch.nn.Module, tuple[str, ...]]]:
    """The loaded pipeline's modules under the names and patterns of :data:`QUANTIZABLE` (``--quantization``);
    the routed experts (``experts.w1/w2/w3``, grouped matmuls) are not quantized."""
    out = {"transformer": (pipeline.transformer, QUANTIZABLE["transformer"])}
    if pipeline.text_encoder is not None and not pipeline.text_encoder_on_host:  # a host-resident one stays as loaded
        out["text_encoder"] = (pipeline.text_encoder.model, QUANTIZABLE["text_encoder"])
    if pipeline.refiner is not None:
        out["refiner"] = (pipeline.refiner, QUANTIZABLE["refiner"])
    return out
