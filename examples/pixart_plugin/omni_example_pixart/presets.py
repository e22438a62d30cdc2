"""The ``tiny:pixart`` preset: a random-weight PixArt-Sigma checkpoint in the real diffusers layout.

Built from configs (no download): a 2-layer T5 encoder with a small word-piece vocabulary, a 2-layer PixArt
transformer, a 2-level AutoencoderKL (2 pixels per latent cell where the real one has 8, so a 64 x 64 image is
32 x 32 latents) and the DPM-Solver++ scheduler PixArt-Sigma ships with, saved with ``save_pretrained`` so the
plugin loads it through the same ``PixArtSigmaPipeline.from_pretrained`` as a real checkpoint. It outputs noise.
"""

from __future__ import annotations

import string
from pathlib import Path

WORDS = ("a", "an", "the", "of", "on", "in", "with", "red", "green", "blue", "small", "large", "cat", "dog", "fox",
         "cube", "table", "wooden", "snow", "sky", "photo", "painting")


def build_tiny(target: str | Path, seed: int = 0) -> None:
    import torch
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    pieces = ["<pad>", "</s>", "<unk>", "\u2581", *(f"\u2581{w}" for w in WORDS), *string.ascii_lowercase]
    tokenizer = T5Tokenizer(vocab=[(p, 0.0 if i < 3 else -1.0 - i / 100) for i, p in enumerate(pieces)], extra_ids=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = T5EncoderModel(T5Config(vocab_size=len(pieces), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, relative_attention_num_buckets=8))
        transformer = PixArtTransformer2DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
            cross_attention_dim=32, caption_channels=32, sample_size=32, patch_size=2, norm_num_groups=4,
            interpolation_scale=1)
        vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                            sample_size=64)
    scheduler = DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02)
    pipe = PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                               transformer=transformer.eval(), scheduler=scheduler)
    pipe.save_pretrained(str(target), safe_serialization=True)
