"""Tiny random-weight MiniMax-H3 repositories in the diffusers layout.

``build_tiny_fl2va(dir)`` writes the FL2VA partition (``transformer/``, tasks t2va and fl2va) and
``build_tiny_ref2va(dir)`` the Ref2VA one (``transformer_ref/``). Both also write ``text_encoder/`` (a Qwen3-VL
with 51 hidden-32 decoder layers of 8 query and 4 K/V heads, so that ``hidden_states[50]`` — the layer the release
reads — exists and diffusers' own pipeline accepts it), ``tokenizer/`` and ``processor/`` (a byte-level tokenizer
holding the Qwen special tokens and the Qwen2-VL image processor), ``vae/`` (a tiny
``AutoencoderKLMiniMaxH3``), ``audio_vae/`` (a tiny ``AutoencoderKLMiniMaxH3Audio`` whose decoder upsamples in two
stages so 4 s decode in a fraction of a second), ``scheduler/`` + ``audio_scheduler/`` (shift 12 / 3) and
``model_index.json`` whose ``_minimax_h3`` block names the partition and a 64-pixel canvas (the release uses 768).

Every component is what ``save_pretrained`` writes, so the result loads through the normal loader and through
diffusers' modular pipeline alike. The same seed always gives the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omnicore.plugin import build_tiny_qwen3_vl, init_visible_weights, read_json_or_empty

SEED = 20260601
#: The release reads hidden_states[50]; one more layer keeps the read pre-norm (and diffusers accepts it).
TEXT_LAYERS = 51
TEXT_HIDDEN = 32
#: grouped-query like the release (64 query heads share 8 K/V heads): 8 heads of 16 share 4 K/V heads, so the text
#: encoder splits under tp=2 and tp=4 like the DiT (each rank whole K/V heads and the query heads that read them)
TEXT_HEADS, TEXT_KV_HEADS = 8, 4
TINY_CANVAS_SHORT_EDGE = 64
TINY_CANVAS_MAX_PIXELS = 64 * 112
TINY_REFERENCE_SHORT_EDGE = 64

#: 4 heads of 16 (q/k/v stay 64 wide, as wide as the hidden size): ``--parallel tp=2,ulysses=2`` needs the heads to
#: divide by 4 (each TP rank's 2 heads split again over its Ulysses pair); RoPE rotates 6 x 2 = 12 of each head's 16
#: channels, so the partial rotation (the release: 96 of 128) stays exercised.
TINY_DIT: dict[str, Any] = {
    "num_layers": 2, "num_refiner_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "attention_head_dim": 16,
    "ffn_dim": 128, "in_channels": 24, "audio_in_channels": 32, "patch_size": [1, 2, 2], "text_dim": TEXT_HIDDEN,
    "freq_dim": 32, "time_embed_hidden_dim": 64, "time_embed_dim": 32, "rope_freq_dim": 2,
}
TINY_VAE: dict[str, Any] = {
    "block_out_channels": [32] * 6, "layers_per_block": 1, "norm_num_groups": 8, "decoder_num_layers": 1,
    "decoder_num_attention_heads": 2, "decoder_attention_head_dim": 16,
}
#: Smaller than (decoder_dim 256 over 7 stages took ~10 s for 4 s of audio on CPU):
#: a one-stage encoder and a two-stage decoder (40 x 20 = 800 samples per latent, the release's hop) decode 4 s
#: in ~0.3 s with the same module types.
TINY_AUDIO_VAE: dict[str, Any] = {
    "encoder_dim": 8, "encoder_rates": [800], "latent_dim": 32, "latent_channels": 32, "num_attention_heads": 2,
    "decoder_dim": 4, "decoder_rates": [40, 20], "decoder_kernel_sizes": [80, 40], "resblock_kernel_sizes": [3],
    "resblock_dilation_sizes": [[1]],
}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def randomize_(module: torch.nn.Module, seed: int, *, gain: float = 1.0) -> None:
    """Non-trivial values everywhere (zero-initialised AdaLN projections and gates would hide bugs): the core's
    rules (matrices ~ N(0, gain²/fan_in), norm weights ~ 1 + N(0, 0.1²), other vectors ~ N(0, 0.1²))."""
    init_visible_weights(module, seed, gain=gain)


def build_transformer(target: Path, seed: int) -> None:
    """A diffusers ``MiniMaxH3Transformer3DModel`` (tiny, randomised) written with ``save_pretrained``."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    model: Any = MiniMaxH3Transformer3DModel(**TINY_DIT)
    randomize_(model, seed)
    model.save_pretrained(str(target))


def build_vaes(root: Path, seed: int) -> None:
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    torch.manual_seed(seed)
    video: Any = AutoencoderKLMiniMaxH3(**TINY_VAE)
    video.save_pretrained(str(root / "vae"))
    torch.manual_seed(seed + 1)
    audio: Any = AutoencoderKLMiniMaxH3Audio(**TINY_AUDIO_VAE, latents_mean=[0.0] * 32, latents_std=[1.0] * 32)
    audio.save_pretrained(str(root / "audio_vae"))


def build_tiny(target_dir: str | Path, partitions: tuple[str, ...], seed: int = SEED) -> Path:
    """Write a complete tiny repository holding ``partitions`` (``"fl2va"`` and/or ``"ref2va"``)."""
    root = Path(target_dir)
    root.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        if "fl2va" in partitions:
            build_transformer(root / "transformer", seed)
        if "ref2va" in partitions:
            build_transformer(root / "transformer_ref", seed + 7)
        # processor/: the tokenizer plus the Qwen2-VL image processor (the release ships a full Qwen3VLProcessor, which
        # transformers only builds with torchvision installed, so the tiny repository carries the parts we read)
        build_tiny_qwen3_vl(root / "text_encoder", root / "processor", seed + 1, tokenizer_dir=root / "tokenizer",
                            hidden_size=TEXT_HIDDEN, layers=TEXT_LAYERS, heads=TEXT_HEADS, kv_heads=TEXT_KV_HEADS)
        build_vaes(root, seed + 2)
    for name, shift in (("scheduler", 12.0), ("audio_scheduler", 3.0)):
        _write_json(root / name / "scheduler_config.json",
                    {"_class_name": "MiniMaxH3Scheduler", "_diffusers_version": "0.42.1", "shift": shift})
    index: dict[str, Any] = {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_diffusers_version": "0.42.1",
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        "vae": ["diffusers", "AutoencoderKLMiniMaxH3"],
        "audio_vae": ["diffusers", "AutoencoderKLMiniMaxH3Audio"],
        "scheduler": ["diffusers", "MiniMaxH3Scheduler"],
        "audio_scheduler": ["diffusers", "MiniMaxH3Scheduler"],
        "_minimax_h3": {
            "partitions": list(partitions),
            "tasks": [t for p in partitions for t in (("t2va", "fl2va") if p == "fl2va" else ("ref2va",))],
            "sigma_shift_scales": {"video": 12.0, "audio": 3.0},
            "canvas_short_edge": TINY_CANVAS_SHORT_EDGE,
            "canvas_max_pixels": TINY_CANVAS_MAX_PIXELS,
            "reference_image_short_edge": TINY_REFERENCE_SHORT_EDGE,
        },
    }
    if "fl2va" in partitions:
        index["transformer"] = ["diffusers", "MiniMaxH3Transformer3DModel"]
    if "ref2va" in partitions:
        index["transformer_ref"] = ["diffusers", "MiniMaxH3Transformer3DModel"]
    _write_json(root / "model_index.json", index)
    return root


def build_tiny_fl2va(target_dir: str | Path) -> Path:
    """``tiny:minimax-h3``: the FL2VA partition (t2va and fl2va)."""
    return build_tiny(target_dir, ("fl2va",))


def build_tiny_ref2va(target_dir: str | Path) -> Path:
    """``tiny:minimax-h3-ref2va``: the Ref2VA partition (ref2va only)."""
    return build_tiny(target_dir, ("ref2va",))


def build_tiny_combined(target_dir: str | Path) -> Path:
    """Both partitions in one repository (the "combined" deployment; used by tests)."""
    return build_tiny(target_dir, ("fl2va", "ref2va"))


# ---------------------------------------------------------------------------------------------- real-size configs
# ``omnicore plan real:minimax-h3`` reads these: the released FL2VA partition's configs and no weights, so a plan
# (what fits where) is made before anything is downloaded. The DiT and the text encoder's decoder are the values
# (Qwen3-VL-32B text: 5120 hidden, 64 heads, 8 KV heads, 25600 FFN; the DiT reads 50 of
# its 64 layers); the vision tower is Qwen3-VL's published 27-block tower, and both VAEs are diffusers' class
# defaults (``AutoencoderKLMiniMaxH3`` / ``...Audio``), which we did not check against a downloaded checkpoint.

#: Preset name -> builder of a configs-only repository (no tensors), read by ``omnicore plan``.
REAL_PRESETS: dict[str, str] = {"real:minimax-h3": "omni_minimax_h3.presets:build_real_minimax_h3"}
REAL_TEXT: dict[str, Any] = {
    "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
    "rope_theta": 5000000.0,
    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
}
REAL_VISION: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 5120, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
#: Which parts of the release these configs are sure of (shown by ``omnicore plan``).
REAL_PROVENANCE = {
    "transformer": "release",
    "text_encoder": "Qwen3-VL-32B text decoder, first 50 of 64 layers kept; vision tower: "
                    "Qwen3-VL's published config (unverified against the checkpoint)",
    "vae": "diffusers AutoencoderKLMiniMaxH3 defaults (unverified)",
    "audio_vae": "diffusers AutoencoderKLMiniMaxH3Audio defaults (unverified)",
}


def build_real_minimax_h3(target_dir: str | Path) -> Path:
    """Configs of the released FL2VA partition in the diffusers layout, without any weights."""
    from transformers import Qwen3VLConfig

    from .transformer.config import MiniMaxH3TransformerConfig

    root = Path(target_dir)
    dit = {"_class_name": "MiniMaxH3Transformer3DModel", **attrs_dict(MiniMaxH3TransformerConfig())}
    _write_json(root / "transformer" / "config.json", dit)
    text = Qwen3VLConfig(text_config=dict(REAL_TEXT), vision_config=dict(REAL_VISION), image_token_id=151655,
                         video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    _write_json(root / "text_encoder" / "config.json", text.to_dict())
    _write_json(root / "vae" / "config.json", {"_class_name": "AutoencoderKLMiniMaxH3"})
    _write_json(root / "audio_vae" / "config.json", {"_class_name": "AutoencoderKLMiniMaxH3Audio"})
    for name in ("tokenizer", "processor"):
        (root / name).mkdir(parents=True, exist_ok=True)
    for name, shift in (("scheduler", 12.0), ("audio_scheduler", 3.0)):
        _write_json(root / name / "scheduler_config.json",
                    {"_class_name": "MiniMaxH3Scheduler", "_diffusers_version": "0.42.1", "shift": shift})
    _write_json(root / "model_index.json", {
        "_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"],
        "_minimax_h3": {"partitions": ["fl2va"], "tasks": ["t2va", "fl2va"], "weights": False,
                        "sigma_shift_scales": {"video": 12.0, "audio": 3.0}, "provenance": REAL_PROVENANCE},
    })
    return root


def attrs_dict(config: Any) -> dict[str, Any]:
    import attrs

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(config).items()}


# ---------------------------------------------------------------------------------------------- the planner's view
#: Linears the weight-only quantizer may replace (DiT block and refiner linears, text-encoder decoder linears);
#: never norms, embeddings, patch projections, the final layer or the AdaLN projections.
QUANTIZABLE = {
    "transformer": ("blocks.*.attn.qkv_proj", "blocks.*.attn.out_proj", "blocks.*.mlp.fc1", "blocks.*.mlp.fc2",
                    "token_refiner.blocks.*.attn.*_proj", "token_refiner.blocks.*.mlp.fc*"),
    "text_encoder": ("language_model.layers.*.self_attn.*_proj", "language_model.layers.*.mlp.*_proj"),
}


def plan_model(root: str | Path, dtype: torch.dtype) -> dict[str, Any]:
    """The components as :meth:`MiniMaxH3Pipeline.from_pretrained` holds them, built on the meta device (no
    weights read) and cast with the same policies (the DiT's fp32 islands, the text encoder truncated to the
    layer it reads, both VAEs in float32), plus the DiT shape the activation estimate needs."""
    from omnicore.plugin import qwen3_vl_tp_plan
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from .repository import resolve_layout
    from .transformer.model import MiniMaxH3DiT
    from .transformer.tensor_parallel import module_plan

    layout = resolve_layout(root)
    components: dict[str, torch.nn.Module] = {}
    dit_cfg = None
    for part, folder in sorted(layout.transformers.items()):
        from .loader import read_transformer_config

        cfg = read_transformer_config(folder)
        dit_cfg = dit_cfg or cfg
        with torch.device("meta"):
            dit = MiniMaxH3DiT(cfg)
        components["transformer" if part == "fl2va" else "transformer_ref"] = (
            dit.float() if dtype == torch.float32 else dit.cast(dtype))
    config = Qwen3VLConfig.from_pretrained(str(layout.text_encoder))
    text: Any = config.text_config
    layer = layout.settings.text_encoder_layer
    text.num_hidden_layers = layer
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:layer]
    with torch.device("meta"):
        components["text_encoder"] = Qwen3VLForConditionalGeneration(config).model.to(dtype)
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    for name, cls, folder in (("vae", AutoencoderKLMiniMaxH3, layout.video_vae),
                              ("audio_vae", AutoencoderKLMiniMaxH3Audio, layout.audio_vae)):
        with torch.device("meta"):
            components[name] = cls.from_config(cls.load_config(str(folder))).float()
    assert dit_cfg is not None
    return {
        "components": components,
        "dit": "transformer" if "transformer" in components else "transformer_ref",
        # what MiniMaxH3Pipeline.offload_modules moves (the DiTs; the text encoder and VAEs stay resident)
        "offload_modules": [k for k in components if k.startswith("transformer")],
        "shape": {"layers": dit_cfg.num_layers, "hidden": dit_cfg.hidden_size, "heads": dit_cfg.num_attention_heads,
                  "head_dim": dit_cfg.attention_head_dim, "ffn": dit_cfg.ffn_dim, "block_prefix": "blocks."},
        "quantizable": QUANTIZABLE,
        # the plans the loader shards with (--parallel tp=N), so a plan's TP bytes are the load's
        "tp_plans": {**{name: module_plan(dit_cfg) for name in components if name.startswith("transformer")},
                     "text_encoder": qwen3_vl_tp_plan(text)},
        "cfg_capable": False,  # CFG-distilled: one forward per step
        "text_encoder": "text_encoder",  # what text_encoder_offload=cpu keeps in host memory (whole, unquantized)
        "provenance": (read_json_or_empty(Path(root) / "model_index.json").get("_minimax_h3") or {}).get(
            "provenance"),
    }




def plan_request(root: str | Path, request: dict[str, Any]) -> dict[str, Any]:
    """Sequence sizes of one request under the model's own rules (frames on the 17n+5 grid, the canvas of the
    aspect ratio, the packed rows ``text + audio + video`` padded to 64). The text length is the prompt's UTF-8
    byte count capped at 512 when a prompt is given (a byte-level upper bound), else 256 (stated, not measured)."""
    from omnicore.plugin import SamplingParams, check_extra

    from .plugin import MODEL_SPEC
    from .repository import resolve_layout
    from .request_rules import SEQ_ALIGN, Deployment, resolve_request

    layout = resolve_layout(root)
    s = layout.settings
    deployment = Deployment(partitions=tuple(sorted(layout.transformers)), canvas_short_edge=s.canvas_short_edge,
                            canvas_max_pixels=s.canvas_max_pixels, video_shift=s.video_shift,
                            audio_shift=s.audio_shift)
    fields = {k: v for k, v in request.items() if k not in ("extra", "prompt")}
    params = SamplingParams(**fields)
    check_extra(dict(request.get("extra") or {}), MODEL_SPEC)
    prompt = str(request.get("prompt") or "a plan")
    r = resolve_request(prompt=prompt, negative_prompt=None, params=params, extra=dict(request.get("extra") or {}),
                        media=(), deployment=deployment)
    from .loader import read_transformer_config

    cfg = read_transformer_config(next(iter(layout.transformers.values())))
    _, ph, pw = cfg.patch_size
    text = min(len(prompt.encode()), 512) if request.get("prompt") else 256
    video = r.num_latent_frames * (r.height // 16 // ph) * (r.width // 16 // pw)
    audio = 2 * r.num_audio_latents
    used = text + audio + video
    rows = -(-used // SEQ_ALIGN) * SEQ_ALIGN
    return {"tokens": rows * r.num_outputs, "text_tokens": text, "cfg_branches": 1, "steps": r.steps,
            "adaln_rows_per_step": 2 * 3,  # unique timesteps per step (video t, audio t) x 3 modalities
            "resolved": {"task": r.task, "height": r.height, "width": r.width, "num_frames": r.num_frames,
                         "latent_frames": r.num_latent_frames, "audio_latents": r.num_audio_latents,
                         "video_rows": video, "audio_rows": audio, "text_rows": text, "padded_rows": rows,
                         "num_outputs": r.num_outputs}}


def quantization_targets(pipeline: Any) -> dict[str, tuple[torch.nn.Module, tuple[str, ...]]]:
    """The loaded pipeline's modules under the names and patterns of :data:`QUANTIZABLE` (``--quantization``)."""
    out: dict[str, tuple[torch.nn.Module, tuple[str, ...]]] = {}
    for part, dit in pipeline.transformers.items():
        out["transformer" if part == "fl2va" else "transformer_ref"] = (dit, QUANTIZABLE["transformer"])
    if pipeline.text_encoder is not None and not pipeline.text_encoder_on_host:  # a host-resident one stays as loaded
        out["text_encoder"] = (pipeline.text_encoder.model, QUANTIZABLE["text_encoder"])
    return out
