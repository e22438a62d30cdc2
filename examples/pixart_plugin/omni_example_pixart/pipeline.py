"""``PixArtPipeline``: diffusers' stock ``PixArtSigmaPipeline`` driven one denoise step at a time by omnicore."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import PixArtSigmaPipeline
from omnicore.plugin import (BasePipeline, BlockLoop, DenoiseState, GenerationRequest, InvalidRequest, LoadOptions,
                             Output, output_seeds, route_diffusers_attention)


class PixArtPipeline(BasePipeline):
    def __init__(self, pipe: PixArtSigmaPipeline, device: torch.device) -> None:
        self.pipe, self.device, self.transformer = pipe, device, pipe.transformer
        self.block_loop = BlockLoop(blocks="transformer.transformer_blocks", streams=("hidden_states",))
        self.offload_modules = {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder}

    @classmethod
    def from_pretrained(cls, path: Path, options: LoadOptions) -> PixArtPipeline:
        pipe = PixArtSigmaPipeline.from_pretrained(path, dtype=options.dtype).to(options.platform.device())
        route_diffusers_attention(pipe.transformer, options)  # attention runs on the backend omnicore selects
        return cls(pipe, options.platform.device())

    def preprocess(self, request: GenerationRequest) -> GenerationRequest:
        params = request.params.with_defaults(self.spec.defaults)
        multiple = self.pipe.vae_scale_factor * self.transformer.config.patch_size
        for name in ("height", "width"):
            if getattr(params, name) % multiple:
                raise InvalidRequest(f"params.{name}", f"must be a multiple of {multiple}")
        if params.num_frames != 1:
            raise InvalidRequest("params.num_frames", "PixArt-Sigma makes images: num_frames must be 1")
        if not isinstance(request.prompt, str):
            raise InvalidRequest("prompt", "must be a string")
        for key in request.extra:
            raise InvalidRequest(f"extra.{key}", "PixArt-Sigma takes no model-specific fields")
        negative = request.negative_prompt or self.spec.defaults.negative_prompt or ""
        return request.evolve(params=params, negative_prompt=negative, prepared=True)

    @torch.no_grad()
    def encode(self, requests: Sequence[GenerationRequest]) -> DenoiseState:
        p, pipe = requests[0].params, self.pipe  # a batch shares its batch key: sizes, steps, guidance
        rows = [(r, seed) for r in requests for seed in output_seeds(r)]  # one latent row per output
        text, mask, neg, neg_mask = pipe.encode_prompt(
            [r.prompt for r, _ in rows], p.guidance_scale > 1, negative_prompt=[r.negative_prompt for r, _ in rows],
            device=self.device, clean_caption=False)
        shape = (1, self.transformer.config.in_channels, p.height // pipe.vae_scale_factor,
                 p.width // pipe.vae_scale_factor)
        noise = torch.cat([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for _, s in rows])
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # one per batch: schedulers keep state
        scheduler.set_timesteps(p.num_inference_steps, device=self.device)
        extras = {"scheduler": scheduler, "guidance": p.guidance_scale,  # text, mask: [branch, row, token, ...]
                  "text": torch.stack([neg, text] if neg is not None else [text]),
                  "mask": torch.stack([neg_mask, mask] if neg is not None else [mask])}
        return DenoiseState(requests=list(requests), num_steps=p.num_inference_steps, timesteps=scheduler.timesteps,
                            latents=noise.to(self.device, pipe.dtype) * scheduler.init_noise_sigma, extras=extras)

    @torch.no_grad()
    def predict(self, state: DenoiseState, step: int) -> torch.Tensor:
        x, ex = state.latents, state.extras
        branches = ex["text"].shape[0]  # 2 with classifier-free guidance (uncond, cond), else 1
        out = self.transformer(x.repeat(branches, 1, 1, 1), timestep=state.timesteps[step].expand(branches * len(x)),
                               encoder_hidden_states=ex["text"].flatten(0, 1),
                               encoder_attention_mask=ex["mask"].flatten(0, 1),
                               added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]
        out = out[:, : x.shape[1]]  # PixArt also predicts the variance: keep the noise half
        if branches == 1:
            return out
        uncond, cond = out.chunk(2)
        return uncond + ex["guidance"] * (cond - uncond)

    def update(self, state: DenoiseState, step: int, prediction: torch.Tensor) -> DenoiseState:
        scheduler = state.extras["scheduler"]
        state.latents = scheduler.step(prediction, state.timesteps[step], state.latents, return_dict=False)[0]
        return state

    def select_requests(self, state: DenoiseState, keep: Sequence[int]) -> DenoiseState:
        owners = [i for i, r in enumerate(state.requests) for _ in range(r.params.num_outputs)]
        rows = torch.tensor([row for row, owner in enumerate(owners) if owner in keep], device=self.device)
        ex, state.requests = state.extras, [state.requests[i] for i in keep]
        state.latents, ex["text"], ex["mask"] = state.latents[rows], ex["text"][:, rows], ex["mask"][:, rows]
        history = ex["scheduler"].model_outputs  # the multistep solver's earlier predictions, one row per output
        history[:] = [h if h is None else h[rows] for h in history]
        return state

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> list[Output]:
        vae = self.pipe.vae
        pixels = vae.decode(state.latents / vae.config.scaling_factor, return_dict=False)[0]
        frames = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
        return [Output(kind="image", frames=f[None].numpy()) for f in frames]
