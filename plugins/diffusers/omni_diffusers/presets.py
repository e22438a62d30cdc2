"""Tiny random-weight checkpoints written by diffusers' own classes and ``save_pretrained`` (no download).

``tiny:diffusers-flux`` (FluxPipeline), ``tiny:diffusers-flux-modular`` (the same components as diffusers'
modular ``FluxAutoBlocks``), ``tiny:diffusers-flux-img2img`` (FluxImg2ImgPipeline: role
``reference``), ``tiny:diffusers-flux-inpaint`` (FluxInpaintPipeline: roles ``edit_source`` + ``mask``) share one
set of FLUX components; ``tiny:diffusers-sd3`` is a StableDiffusion3Pipeline; ``tiny:diffusers-wan`` is a
WanPipeline (text to video). Tokenizers are byte-level BPE
tokenizers built from an alphabet (``byte_level_tokenizer``), so nothing is fetched from the hub. The components
are small enough that a 32x32, 2-step request takes well under a second on a CPU; the outputs are noise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from omnicore.plugin import byte_level_tokenizer

SPECIALS = ("<pad>", "</s>", "<unk>", "<|startoftext|>", "<|endoftext|>")


def _tokenizer(max_length: int) -> Any:
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        made = byte_level_tokenizer(tmp, SPECIALS, eos_token="</s>", pad_token="<pad>", model_max_length=max_length)
        return PreTrainedTokenizerFast.from_pretrained(str(made.path)), made.vocab_size


def _t5(vocab: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8)).eval()


def flux_components(seed: int = 0) -> dict[str, Any]:
    """The components of a 1+1-layer FLUX (CLIP + T5 text encoders, 1-channel latent VAE, flow-match scheduler)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    clip_tok, vocab = _tokenizer(16)
    t5_tok, _ = _tokenizer(32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
        clip = CLIPTextModel(CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=0, hidden_size=32,
                                            intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4,
                                            num_hidden_layers=2, vocab_size=vocab, hidden_act="gelu",
                                            projection_dim=32, max_position_embeddings=16))
        t5 = _t5(vocab)
        vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
                            layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                            use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "text_encoder": clip.eval(), "tokenizer": clip_tok,
            "text_encoder_2": t5, "tokenizer_2": t5_tok, "transformer": transformer, "vae": vae}


def _save(pipeline_class: str, components: dict[str, Any], target: str | Path) -> None:
    import diffusers

    getattr(diffusers, pipeline_class)(**components).save_pretrained(str(target), safe_serialization=True)


def build_flux(target: str | Path) -> None:
    _save("FluxPipeline", flux_components(), target)


def build_flux_modular(target: str | Path) -> None:
    """The same FLUX components as a modular pipeline (``FluxAutoBlocks``), written by its ``save_pretrained``:
    a ``modular_model_index.json`` checkpoint."""
    from diffusers.modular_pipelines import FluxAutoBlocks

    pipe = FluxAutoBlocks().init_pipeline()  # type: ignore[attr-defined, unused-ignore]
    pipe.update_components(**flux_components())
    pipe.save_pretrained(str(target), overwrite_modular_index=True)


def build_flux_img2img(target: str | Path) -> None:
    _save("FluxImg2ImgPipeline", flux_components(), target)


def build_flux_inpaint(target: str | Path) -> None:
    _save("FluxInpaintPipeline", flux_components(), target)


def wan_components(seed: int = 0) -> dict[str, Any]:
    """A 2-layer Wan 2.1-style text-to-video model with a 3-channel-base causal video VAE."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    tok, vocab = _tokenizer(32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
        text_encoder = _t5(vocab)
        transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                            in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                            num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                            rope_max_seq_len=32)
    return {"vae": vae, "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
            "text_encoder": text_encoder, "tokenizer": tok, "transformer": transformer}


def build_wan(target: str | Path) -> None:
    _save("WanPipeline", wan_components(), target)


def sd3_components(seed: int = 0) -> dict[str, Any]:
    """A 1-layer Stable Diffusion 3 (two CLIP encoders with projections, a T5, a 4-channel latent VAE)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    clip_tok, vocab = _tokenizer(16)
    clip_tok_2, _ = _tokenizer(16)
    t5_tok, _ = _tokenizer(32)
    clip = CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=0, hidden_size=32, intermediate_size=37,
                          layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=2, vocab_size=vocab,
                          hidden_act="gelu", projection_dim=32, max_position_embeddings=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=1,
                                            attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                            joint_attention_dim=32, pooled_projection_dim=64, out_channels=4)
        text_encoder = CLIPTextModelWithProjection(clip).eval()
        text_encoder_2 = CLIPTextModelWithProjection(clip).eval()
        t5 = _t5(vocab)
        vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
                            layers_per_block=1, latent_channels=4, norm_num_groups=1, use_quant_conv=False,
                            use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "text_encoder": text_encoder, "tokenizer": clip_tok,
            "text_encoder_2": text_encoder_2, "tokenizer_2": clip_tok_2, "text_encoder_3": t5,
            "tokenizer_3": t5_tok, "transformer": transformer, "vae": vae}


def build_sd3(target: str | Path) -> None:
    _save("StableDiffusion3Pipeline", sd3_components(), target)
