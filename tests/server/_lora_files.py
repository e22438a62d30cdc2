"""LoRA adapter files written directly with safetensors, in the layouts the core reads: PEFT/diffusers directories
(``adapter_config.json`` + ``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_A.weight``) and one
kohya/A1111 file (``lora_unet_<module_with_underscores>.lora_down.weight`` / ``lora_up`` / ``alpha``).

Random A/B (seeded), so an adapter visibly changes a toy's output. Shared by the server and CLI LoRA tests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

#: the toy denoiser's adaptable linears (tests/toy/model.py): name -> (in_features, out_features)
TOY_LINEARS = {"mlp.0": (64, 64), "mlp.1": (64, 64), "time_proj": (64, 64)}


def _pair(shape: tuple[int, int], rank: int, seed: int, std: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fan_in, fan_out = shape
    return torch.randn(rank, fan_in, generator=g) * std, torch.randn(fan_out, rank, generator=g) * std


def write_peft(out: Path, modules: Mapping[str, tuple[int, int]], *, rank: int = 4, alpha: float | None = None,
               seed: int = 0, std: float = 0.3, base_model: str = "tiny:toy", config_rank: int | None = None,
               extra: Mapping[str, torch.Tensor] | None = None) -> Path:
    """A PEFT adapter directory as ``save_pretrained`` writes it (``config_rank``: a config ``r`` other than the
    weights' rank; ``extra``: more tensors in the file — both make a broken adapter)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, (name, shape) in enumerate(sorted(modules.items())):
        a, b = _pair(shape, rank, seed * 1000 + i, std)
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    tensors.update(extra or {})
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank if config_rank is None else config_rank,
              "lora_alpha": alpha if alpha is not None else rank,
              "target_modules": sorted(modules), "base_model_name_or_path": base_model, "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def write_kohya(out: Path, modules: Mapping[str, tuple[int, int]], *, rank: int = 4, alpha: float = 4.0,
                seed: int = 0, std: float = 0.3) -> Path:
    """One kohya/A1111 ``.safetensors`` file."""
    tensors = {}
    for i, (name, shape) in enumerate(sorted(modules.items())):
        a, b = _pair(shape, rank, seed * 1000 + i, std)
        flat = "lora_unet_" + name.replace(".", "_")
        tensors[f"{flat}.lora_down.weight"] = a.contiguous()
        tensors[f"{flat}.lora_up.weight"] = b.contiguous()
        tensors[f"{flat}.alpha"] = torch.tensor(float(alpha))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    return out
