"""``toy-adaln``: the toy model with transformer-like blocks that own AdaLN projections (test-only).

It declares everything the engine's memory features use, the way a real DiT plugin would:

- ``adaln_schedule`` + ``adaln_schedule_plan`` — the exact-schedule AdaLN cache (every block's
  :class:`~omnicore.cache.adaln_schedule.AdaLNProjection` maps the timestep embedding to shift/scale/gate);
- ``block_loop`` — layer-wise offload and the first-block cache;
- ``offload_modules`` — model-level offload of the transformer (text embedding and decoder stay resident);
- ``teacache_adapter`` (inherited from :class:`~toy.pipeline.ToyPipeline`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
from omnicore.cache.adaln_schedule import (
    ABSENT,
    STATE_STEP_KEY,
    AdaLNProjection,
    AdaLNScheduleController,
    schedule_key,
    step_timesteps,
)
from omnicore.engine.protocol import DenoiseState, LoadOptions
from omnicore.specs import ModelCapabilities, ModelSpec, PresetSpec, RequestDefaults
from safetensors.torch import load_file, save_file
from torch import nn

from .model import ToyConfig, prompt_token_ids, timestep_embedding
from .pipeline import ToyPipeline

MODEL_TYPE = "omnicore-toy-adaln"


@attrs.frozen
class ToyAdaLNConfig(ToyConfig):
    blocks: int = 2

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "architectures": ["ToyAdaLNDiT"], "model_type": MODEL_TYPE}


class ToyAdaLNBlock(nn.Module):
    """``h + gate * conv(silu(h * (1 + scale) + shift))`` with shift/scale/gate from the timestep embedding."""

    def __init__(self, cfg: ToyAdaLNConfig) -> None:
        super().__init__()
        self.adaln_proj = AdaLNProjection(cfg.work, cfg.hidden, expand_ratio=3)
        self.conv = nn.Conv2d(cfg.hidden, cfg.hidden, 3, padding=1)

    def forward(self, hidden_states: torch.Tensor, t_emb: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = (m[rows][:, :, None, None] for m in self.adaln_proj(t_emb))
        return hidden_states + gate * self.conv(nn.functional.silu(hidden_states * (1 + scale) + shift))


class ToyAdaLNTransformer(nn.Module):
    def __init__(self, cfg: ToyAdaLNConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.time_proj = nn.Linear(cfg.work, cfg.work)
        self.mlp = nn.ModuleList(nn.Linear(cfg.work, cfg.work) for _ in range(cfg.work_layers))
        self.modulation = nn.Linear(cfg.work, 2 * cfg.hidden)
        self.conv_in = nn.Conv2d(cfg.latent_channels, cfg.hidden, 3, padding=1)
        self.blocks = nn.ModuleList(ToyAdaLNBlock(cfg) for _ in range(cfg.blocks))
        self.conv_out = nn.Conv2d(cfg.hidden, cfg.latent_channels, 3, padding=1)
        self.adaln = AdaLNScheduleController(lambda: [b.adaln_proj for b in self.blocks], self.time_embed)

    def time_embed(self, unique_timesteps: torch.Tensor) -> torch.Tensor:
        return self.time_proj(timestep_embedding(unique_timesteps, self.cfg.work))

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor,
                adaln_step_index: Any = ABSENT) -> torch.Tensor:
        unique, inverse = torch.unique(t.float(), sorted=True, return_inverse=True)
        t_emb = self.adaln.select(adaln_step_index)
        if t_emb is None:
            t_emb = self.time_embed(unique)
        c = text + t_emb[inverse]
        for layer in self.mlp:
            c = c + nn.functional.silu(layer(c))
        scale, shift = self.modulation(c).chunk(2, dim=-1)
        video = x.dim() == 5
        rows = inverse
        if video:
            b, ch, f, h, w = x.shape
            x = x.permute(0, 2, 1, 3, 4).reshape(b * f, ch, h, w)
            scale, shift = scale.repeat_interleave(f, 0), shift.repeat_interleave(f, 0)
            rows = inverse.repeat_interleave(f, 0)
        hdn = nn.functional.silu(self.conv_in(x)) * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        for block in self.blocks:
            hdn = block(hdn, t_emb, rows)
        out = self.conv_out(hdn)
        if video:
            out = out.reshape(b, f, ch, h, w).permute(0, 2, 1, 3, 4)
        return out


class ToyAdaLNModel(nn.Module):
    """Text embedding + transformer + pixel decoder (the interface :class:`ToyPipeline` drives)."""

    def __init__(self, cfg: ToyAdaLNConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.work)
        self.transformer = ToyAdaLNTransformer(cfg)
        self.decoder = nn.Conv2d(cfg.latent_channels, 3 * cfg.vae_scale**2, 1)

    def encode_text(self, prompts: list[Any]) -> torch.Tensor:
        rows = []
        for p in prompts:
            ids = prompt_token_ids(p, self.cfg.vocab) if p else []
            rows.append(self.embed(torch.tensor(ids)).mean(0) if ids else torch.zeros(self.cfg.work))
        return torch.stack(rows)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.transformer(x, t, text, **kwargs)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        b, ch, f, h, w = latents.shape
        flat = latents.permute(0, 2, 1, 3, 4).reshape(b * f, ch, h, w)
        pix = torch.nn.functional.pixel_shuffle(self.decoder(flat), self.cfg.vae_scale)
        pix = torch.tanh(pix).reshape(b, f, 3, h * self.cfg.vae_scale, w * self.cfg.vae_scale)
        return pix.permute(0, 1, 3, 4, 2)


def build_checkpoint(target: str | Path, config: ToyAdaLNConfig | None = None, *, weight_seed: int = 0) -> Path:
    cfg = config or ToyAdaLNConfig()
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(weight_seed)
        model = ToyAdaLNModel(cfg)
        for block in model.transformer.blocks:  # visible modulation, so a wrong table would show
            nn.init.normal_(block.adaln_proj.linear.weight, std=0.2)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(cfg.to_json(), indent=2))
    return target


def build_tiny(target: str | Path) -> None:
    build_checkpoint(target)


def detect(path: Path) -> bool:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


class ToyAdaLNPipeline(ToyPipeline):
    @classmethod
    def from_pretrained(cls, path: Path, options: LoadOptions) -> ToyAdaLNPipeline:
        path = Path(path)
        cfg = ToyAdaLNConfig.from_json(json.loads((path / "config.json").read_text()))
        model = ToyAdaLNModel(cfg)
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        pipe = cls(model, options)
        pipe.spec = TOY_ADALN_SPEC
        return pipe

    def model_kwargs(self, state: DenoiseState, step: int) -> dict[str, Any]:
        return {STATE_STEP_KEY: state.extras[STATE_STEP_KEY]} if STATE_STEP_KEY in state.extras else {}

    # ------------------------------------------------------------------ declarations
    @property
    def adaln_schedule(self) -> AdaLNScheduleController:
        return self.model.transformer.adaln

    def adaln_schedule_plan(self, state: DenoiseState) -> tuple[list[torch.Tensor], Any]:
        """Per step the unique model timesteps (all rows share the step's ``sigma * 1000``) and the key."""
        metas = [step_timesteps(torch.tensor([float(state.timesteps[s]) * 1000.0], dtype=torch.float32))
                 for s in range(state.num_steps)]
        return [m.unique_timesteps for m in metas], schedule_key(metas)

    @property
    def block_loop(self) -> Any:
        from omnicore.cache import BlockLoop

        return BlockLoop(blocks="model.transformer.blocks", streams=("hidden_states",))

    @property
    def offload_modules(self) -> dict[str, nn.Module]:
        return {"transformer": self.model.transformer}


TOY_ADALN_SPEC = ModelSpec(
    name="toy-adaln",
    impl="toy.adaln:ToyAdaLNPipeline",
    description="Test-only toy with AdaLN blocks (exact-schedule AdaLN cache, offload, block caches).",
    detect="toy.adaln:detect",
    capabilities=ModelCapabilities(
        modes=("t2i", "t2v", "i2i"), outputs=("image", "video"), max_reference_images=1, supports_batching=True,
        max_outputs_per_request=4, cache_methods=("teacache", "first_block_cache", "adaln_schedule"),
        honours_attention_backend=False,  # convolutions only: no attention to route
    ),
    defaults=RequestDefaults(height=32, width=32, num_frames=1, fps=8.0, num_inference_steps=4,
                             guidance_scale=1.0, flow_shift=None),
    presets=(PresetSpec(name="toy-adaln", builder="toy.adaln:build_tiny", description="tiny toy-adaln checkpoint"),),
)
