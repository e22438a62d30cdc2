"""Adapters made with peft itself (random ``lora_A``/``lora_B``), kohya-style files, and peft's merged reference.

Shared by the core LoRA tests and the model plugins' ``test_lora.py`` (helper modules are on sys.path).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omnicore.hookspecs import hookimpl
from omnicore.lora import LoRATargets
from omnicore.specs import ModelSpec
from safetensors.torch import save_file
from torch import nn

# ---------------------------------------------------------------------------------------------- a toy network
MODULES = ("blocks.0.q", "blocks.0.o", "blocks.1.q", "blocks.1.o", "head")


class Toy(nn.Module):
    """Two blocks of linears on ``[B, L, H]`` (or packed ``[T, H]``) rows, and a head."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.ModuleDict({"q": nn.Linear(hidden, 2 * hidden),
                                                   "o": nn.Linear(2 * hidden, hidden)}) for _ in range(2))
        self.head = nn.Linear(hidden, 8)
        self.frozen = nn.Linear(hidden, hidden)  # not a target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["o"](torch.tanh(block["q"](x)))
        return self.head(self.frozen(x))


class Holder:
    def __init__(self, model: nn.Module) -> None:
        self.transformer = model


SPEC = ModelSpec(name="toy", impl="toy.nothing:Nothing", lora=LoRATargets(modules=("blocks.*", "head")))



def peft_config(modules: Sequence[str], rank: int, alpha: float | None = None, **kwargs: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(modules),
                      init_lora_weights=False, **kwargs)


def _randomize(model: nn.Module, seed: int, std: float) -> None:
    """Random lora_A / lora_B (peft's ``init_lora_weights=False`` leaves nn.Linear init; make them seeded)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if ".lora_A." in name or ".lora_B." in name:
            p.data = (torch.randn(p.shape, generator=g) * std).to(p.dtype)


def plain_copy(model: nn.Module) -> nn.Module:
    """A deep copy without forward hooks (a copy would otherwise keep the LoRA runtime's hooks on its linears)."""
    clone = copy.deepcopy(model)
    for module in clone.modules():
        module._forward_hooks.clear()
    return clone


def _peft_ready(model: nn.Module) -> nn.Module:
    """A float32 hook-free copy peft can wrap: a model config that is not a mapping (our attrs configs) is hidden,
    as peft reads ``model.config`` as a dict when it writes its model card."""
    clone = plain_copy(model).float()
    if not isinstance(getattr(clone, "config", {}), dict):
        object.__setattr__(clone, "config", {})
    return clone


def make_peft_adapter(model: nn.Module, modules: Sequence[str], out: Path, *, rank: int = 4, seed: int = 0,
                      alpha: float | None = None, std: float = 0.05, **kwargs: Any) -> Path:
    """Wrap a copy of ``model`` with peft (``get_peft_model``), randomize A and B, and save the adapter with peft's
    own ``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    from peft import get_peft_model

    peft_model = get_peft_model(_peft_ready(model), peft_config(modules, rank, alpha, **kwargs))
    _randomize(peft_model, seed, std)
    peft_model.save_pretrained(str(out))
    return out


def merged_copy(model: nn.Module, adapters: Sequence[tuple[Path, float]]) -> nn.Module:
    """A copy of ``model`` with each adapter merged into its weights by peft (``PeftModel.from_pretrained`` then
    ``merge_and_unload``), scaled as requested: the independent reference for unmerged per-row adapters."""
    from peft import PeftModel

    merged = _peft_ready(model)
    for adapter, scale in adapters:
        peft_model = PeftModel.from_pretrained(merged, str(adapter))
        if scale != 1.0:
            for module in peft_model.modules():
                scaling = getattr(module, "scaling", None)
                if isinstance(scaling, dict) and "default" in scaling:
                    scaling["default"] *= scale
        merged = peft_model.merge_and_unload()
    out = plain_copy(model)
    out.load_state_dict({k: v.to(p.dtype) for (k, v), p in zip(merged.state_dict().items(),
                                                              model.state_dict().values())})
    return out


def peft_to_kohya(adapter: Path, out: Path, *, prefix: str = "lora_unet_") -> Path:
    """The same adapter as one kohya/A1111 safetensors file (``lora_down``/``lora_up``/``alpha``)."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    state = load_file(str(adapter / "adapter_model.safetensors"))
    tensors = {}
    for key, value in state.items():
        module, which = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        flat = prefix + module.replace(".", "_")
        kind = "lora_down" if which.startswith("A") else "lora_up"
        tensors[f"{flat}.{kind}.weight"] = value
        tensors[f"{flat}.alpha"] = torch.tensor(float(cfg["lora_alpha"]))
    save_file(tensors, str(out))
    return out




# ---------------------------------------------------------------------------------------------- engine helpers
class FinalLatents:
    """A plugin keeping each request's latents after the last denoise step (``request_id -> tensor``), read from
    the batch's state in request order (``latents_of`` says how a model lays its latents out)."""

    def __init__(self, latents_of: Any = None) -> None:
        self.latents: dict[str, torch.Tensor] = {}
        self.batch_sizes: list[int] = []
        self.latents_of = latents_of or (lambda state: [state.latents[i] for i in range(len(state.requests))])

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline: Any, state: Any, step: int) -> Any:
        out = yield
        if step == out.num_steps - 1:
            self.batch_sizes.append(len(out.requests))
            for request, latents in zip(out.requests, self.latents_of(out)):
                self.latents[request.request_id] = latents.detach().clone()
        return out


def submit_together(engine: Any, requests: Sequence[Any]) -> list[Any]:
    """Submit every request before the worker forms a batch (the engine's admission wait holds it) and wait."""
    jobs = [engine.submit(r) for r in requests]
    return [job.result(300) for job in jobs]


def merged_weights(module: nn.Module, adapters: Sequence[tuple[Path, float]], *,
                   merged: nn.Module | None = None) -> Any:
    """A context manager: ``module`` (a network the engine runs) holds peft's merged weights inside (or those of
    ``merged``, a reference built another way), its own after."""
    import contextlib

    @contextlib.contextmanager
    def scope() -> Any:
        original = copy.deepcopy(module.state_dict())
        reference = merged if merged is not None else merged_copy(module, adapters)
        module.load_state_dict(reference.state_dict())
        try:
            yield
        finally:
            module.load_state_dict(original)

    return scope()


__all__ = ["MODULES", "SPEC", "FinalLatents", "Holder", "Toy", "make_peft_adapter", "merged_copy", "merged_weights",
           "peft_config", "peft_to_kohya", "plain_copy", "submit_together"]
