"""Reading adapter files and converting them to the model's module names (safetensors only, never pickle).

Two layouts are read:

* **diffusers / PEFT**: a directory with ``adapter_config.json`` + ``adapter_model.safetensors`` (keys
  ``<prefix><module>.lora_A[.<adapter>].weight`` / ``lora_B``; scaling ``lora_alpha / r``, or ``/ sqrt(r)`` with
  ``use_rslora``, per module through ``rank_pattern`` / ``alpha_pattern``, as peft computes it), or a single
  diffusers ``*.safetensors`` file / directory without a config (``save_lora_weights``: scaling 1 unless the file
  carries ``<module>.alpha`` entries);
* **kohya / A1111**: one ``.safetensors`` file with ``lora_unet_<module_with_underscores>.lora_down.weight`` /
  ``lora_up.weight`` / ``.alpha`` (scaling ``alpha / rank``; 1 without ``alpha``); the flattened name is read back
  to a dotted one among the model's modules and the names its converter takes (``LoRATargets.kohya_names``), then
  converted like a PEFT file of those names.

The DiTs served here are not among the architectures diffusers' own key converters know (those cover SD, Flux,
Wan, ...), so names are mapped through the model's :class:`~omnicore.lora.targets.TargetMap`: strip one known
prefix, rewrite the model's aliases, then require an adaptable module of matching shape. Every refusal is a
:class:`~omnicore.lora.errors.LoRAError` naming the adapter and the key.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import attrs

from .errors import LoRAError
from .targets import TargetMap

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_NOT_SAFETENSORS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

_PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_DIFFUSERS_ALPHA = re.compile(r"^(?P<module>.+)\.alpha$")
_KOHYA_KEY = re.compile(r"^(?P<flat>[^.]+)\.(?P<which>lora_down|lora_up)\.weight$")
_KOHYA_ALPHA = re.compile(r"^(?P<flat>[^.]+)\.alpha$")


@attrs.frozen(eq=False)
class RawAdapter:
    """An adapter file as read: its tensors (host), the PEFT config (``{}`` without one) and the layout."""

    label: str  # what the request named (messages)
    source: str  # the resolved path it came from
    layout: str  # "peft" | "diffusers" | "kohya"
    tensors: dict[str, Any]
    config: dict[str, Any]


@attrs.frozen(eq=False)
class AdapterWeights:
    """An adapter converted for one model: module name -> ``(A [r, in], B [out, r] * scaling)`` host tensors
    (float32), ready to be copied to the device."""

    label: str
    source: str
    layout: str
    modules: dict[str, tuple[Any, Any]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.modules.values())

    @property
    def numel(self) -> int:
        return sum(a.numel() + b.numel() for a, b in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def _load_safetensors(path: Path, label: str) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(label, path.name, f"is not a readable safetensors file: {exc}") from exc


def read_adapter(path: Path, label: str) -> RawAdapter:
    """Read the adapter at ``path`` (a PEFT/diffusers directory or one ``.safetensors`` file); detect its layout."""
    if path.is_dir():
        config_file, weights = path / PEFT_CONFIG, path / PEFT_WEIGHTS
        if config_file.is_file():
            if not weights.is_file():
                pickled = sorted(p.name for p in path.iterdir() if p.suffix in _NOT_SAFETENSORS)
                why = f"only {pickled[0]} is there; pickled weights are never opened" if pickled else "is missing"
                raise LoRAError(label, PEFT_WEIGHTS, f"safetensors weights required next to {PEFT_CONFIG}: {why}")
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise LoRAError(label, PEFT_CONFIG, f"is not valid JSON: {exc}") from exc
            if not isinstance(config, dict):
                raise LoRAError(label, PEFT_CONFIG, "must hold a JSON object")
            return RawAdapter(label, str(path), "peft", _load_safetensors(weights, label), config)
        files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
        if len(files) != 1:
            found = "none" if not files else ", ".join(p.name for p in files)
            raise LoRAError(label, None, f"a LoRA directory holds {PEFT_CONFIG} + {PEFT_WEIGHTS}, or exactly one "
                                         f".safetensors file; found {found}")
        path = files[0]
    if path.suffix != ".safetensors":
        raise LoRAError(label, path.name, "only .safetensors adapters are read (pickled formats are never opened)")
    tensors = _load_safetensors(path, label)
    kohya = any(k.startswith(("lora_unet_", "lora_transformer_", "lora_te")) for k in tensors)
    return RawAdapter(label, str(path), "kohya" if kohya else "diffusers", tensors, {})


# ---------------------------------------------------------------------------------------------- conversion


def _check_config(raw: RawAdapter) -> None:
    cfg, label = raw.config, raw.label
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(label, "peft_type", f"only LORA adapters are supported, got {peft_type!r}")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(cfg.get(key, ok)) != ok:
            raise LoRAError(label, key, f"{key}={cfg.get(key)!r} is not supported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise LoRAError(label, "bias", f"adapters that train biases are not supported (bias={cfg['bias']!r})")
    if cfg.get("lora_bias"):
        raise LoRAError(label, "lora_bias", "adapters with a lora_B bias are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(label, "modules_to_save", "adapters that replace whole modules are not supported")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise LoRAError(label, key, f"must be a positive number, got {value!r}")


def _pattern_value(patterns: Any, module: str, default: float) -> float:
    """peft's ``rank_pattern`` / ``alpha_pattern`` lookup: a key naming the module or a suffix of it (or a regex
    matching its end)."""
    if not isinstance(patterns, dict):
        return default
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.search(rf"(^|\.){key}$", module):
            return float(value)
    return default


def _module_name(key_module: str, raw: RawAdapter, tmap: TargetMap, key: str) -> str:
    """The module a key names: one prefix stripped, aliases applied, then required to be adaptable (unless the
    model's converter will rename it)."""
    name = key_module
    for prefix in tmap.targets.prefixes:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for theirs, ours in tmap.targets.aliases:
        if name == theirs or name.startswith(theirs + "."):
            name = ours + name[len(theirs):]
            break
    return name if tmap.targets.converter else _known(name, raw, tmap, key)


def _known(name: str, raw: RawAdapter, tmap: TargetMap, key: str) -> str:
    if name in tmap.shapes:
        return name
    if name in tmap.linears:
        raise LoRAError(raw.label, key, f"module {name!r} of model {tmap.model!r} is not adaptable (LoRA targets: "
                                        f"{', '.join(tmap.targets.modules)})")
    inside = tmap.not_linear(name)
    if inside is not None:
        raise LoRAError(raw.label, key, f"module {inside[0]!r} of model {tmap.model!r} is a {inside[1]}, not an "
                                        "nn.Linear: not adaptable (LoRA adapts the model's linear layers only)")
    raise LoRAError(raw.label, key, f"model {tmap.model!r} has no adaptable module {name!r}")


def _pairs(raw: RawAdapter, tmap: TargetMap) -> tuple[dict[str, dict[str, Any]], dict[str, float], dict[str, str]]:
    """``module -> {"A": t, "B": t}``, ``module -> alpha`` (from ``.alpha`` entries) and ``module -> key``."""
    pairs: dict[str, dict[str, Any]] = {}
    alphas: dict[str, float] = {}
    keys: dict[str, str] = {}
    adapters: set[str] = set()
    kohya = tmap.kohya_names
    for key, tensor in raw.tensors.items():
        if raw.layout == "kohya":
            prefix = next((p for p in tmap.targets.kohya_prefixes if key.startswith(p)), None)
            if prefix is None:
                what = "text-encoder adapters are not supported" if key.startswith("lora_te") else "unknown key"
                raise LoRAError(raw.label, key, f"{what} (expected {'/'.join(tmap.targets.kohya_prefixes)}"
                                                "<module>.lora_down/lora_up.weight or .alpha)")
            rest = key[len(prefix):]
            m, ma = _KOHYA_KEY.match(rest), _KOHYA_ALPHA.match(rest)
            if m is None and ma is None:
                raise LoRAError(raw.label, key, "unknown key (expected .lora_down.weight, .lora_up.weight or .alpha)")
            flat = (m or ma).group("flat")  # type: ignore[union-attr]
            if flat not in kohya:
                raise LoRAError(raw.label, key, f"model {tmap.model!r} has no adaptable module named {flat!r}")
            module = kohya[flat]
            if ma is not None:
                alphas[module] = _scalar(tensor, raw, key)
                continue
            which = "A" if m.group("which") == "lora_down" else "B"  # type: ignore[union-attr]
        else:
            m = _PEFT_KEY.match(key)
            if m is None:
                ma = _DIFFUSERS_ALPHA.match(key)
                if ma is not None and raw.layout == "diffusers":
                    alphas[_module_name(ma.group("module"), raw, tmap, key)] = _scalar(tensor, raw, key)
                    continue
                raise LoRAError(raw.label, key, "unknown key (expected <module>.lora_A.weight / lora_B.weight)")
            if m.group("adapter") is not None:
                adapters.add(m.group("adapter"))
            module = _module_name(m.group("module"), raw, tmap, key)
            which = m.group("which")
        if which in pairs.get(module, {}):
            raise LoRAError(raw.label, key, f"a second lora_{which} for module {module!r}")
        pairs.setdefault(module, {})[which] = tensor
        keys.setdefault(module, key)
    if len(adapters) > 1:
        raise LoRAError(raw.label, None, f"the file holds several adapters ({', '.join(sorted(adapters))}); save one")
    if not pairs:
        raise LoRAError(raw.label, None, "holds no LoRA weights")
    return pairs, alphas, keys


def _scalar(tensor: Any, raw: RawAdapter, key: str) -> float:
    if tensor.numel() != 1 or tensor.dtype.is_complex:
        raise LoRAError(raw.label, key, f"alpha must be one number, got shape {tuple(tensor.shape)}")
    value = float(tensor.reshape(()).item())
    if not math.isfinite(value) or value <= 0:
        raise LoRAError(raw.label, key, f"alpha must be a positive finite number, got {value}")
    return value


def convert(raw: RawAdapter, tmap: TargetMap) -> AdapterWeights:
    """Check ``raw`` against the model (keys, modules, shapes, ranks, finiteness) and fold each module's scaling
    (``alpha / r``) into its ``B``; returns host float32 tensors in the model's module names."""
    import torch

    if raw.layout == "peft":
        _check_config(raw)
    pairs, alphas, keys = _pairs(raw, tmap)
    cfg = raw.config
    scaled: dict[str, tuple[Any, Any]] = {}
    for module, pair in sorted(pairs.items()):
        key = keys[module]
        for which in ("A", "B"):
            if which not in pair:
                missing = {"A": "lora_A / lora_down", "B": "lora_B / lora_up"}[which]
                raise LoRAError(raw.label, key, f"module {module!r} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2:
            raise LoRAError(raw.label, key, f"LoRA weights of {module!r} must be matrices (linear layers only), got "
                                            f"{tuple(a.shape)} and {tuple(b.shape)}")
        rank = a.shape[0]
        if b.shape[1] != rank or rank == 0:
            raise LoRAError(raw.label, key, f"rank mismatch for {module!r}: lora_A has rank {rank}, lora_B "
                                            f"{b.shape[1]}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAError(raw.label, key, f"weights must be floating point, got {a.dtype} / {b.dtype}")
        if raw.layout == "peft":
            r = _pattern_value(cfg.get("rank_pattern"), module, float(cfg.get("r", rank)))
            if int(r) != rank:
                raise LoRAError(raw.label, key, f"rank mismatch for {module!r}: the config says r={int(r)}, the "
                                                f"weights have rank {rank}")
            alpha = _pattern_value(cfg.get("alpha_pattern"), module, float(cfg.get("lora_alpha", r)))
            scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        else:
            scaling = alphas[module] / rank if module in alphas else 1.0
        a32, b32 = a.float().contiguous(), (b.float() * scaling).contiguous()
        if not (bool(torch.isfinite(a32).all()) and bool(torch.isfinite(b32).all())):
            raise LoRAError(raw.label, key, f"weights of {module!r} are not all finite")
        scaled[module] = (a32, b32)
    extra_alpha = sorted(set(alphas) - set(pairs))
    if extra_alpha:
        raise LoRAError(raw.label, extra_alpha[0] + ".alpha", "an alpha for a module without LoRA weights")
    if tmap.targets.converter:  # kohya files too: their names are read back to the dotted names it takes
        scaled = _run_converter(raw, tmap, scaled, keys)
    out: dict[str, tuple[Any, Any]] = {}
    for module, (a, b) in sorted(scaled.items()):
        key = keys.get(module, module)
        _known(module, raw, tmap, key)
        fan_in, fan_out = tmap.shapes[module]
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise LoRAError(raw.label, key, f"shape mismatch for {module!r} ({fan_in} -> {fan_out}): lora_A "
                                            f"{tuple(a.shape)}, lora_B {tuple(b.shape)}")
        out[module] = (a, b)
    return AdapterWeights(raw.label, raw.source, raw.layout, out)


def _run_converter(raw: RawAdapter, tmap: TargetMap, scaled: dict[str, tuple[Any, Any]],
                   keys: dict[str, str]) -> dict[str, tuple[Any, Any]]:
    from .._lazy import resolve

    assert tmap.targets.converter is not None
    try:
        fn = resolve(tmap.targets.converter)
    except Exception as exc:
        raise LoRAError(raw.label, None, f"the model's LoRA converter {tmap.targets.converter!r} cannot be "
                                         f"imported: {exc}") from exc
    try:
        converted = dict(fn(dict(scaled), tmap.config))
    except LoRAError:
        raise
    except (KeyError, ValueError, RuntimeError) as exc:
        raise LoRAError(raw.label, None, f"cannot be converted to model {tmap.model!r}'s modules: {exc}") from exc
    for module in converted:  # name errors after conversion by the source key of a renamed module when known
        keys.setdefault(module, module)
    return converted


__all__ = ["AdapterWeights", "RawAdapter", "convert", "read_adapter"]
