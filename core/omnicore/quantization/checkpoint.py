"""Pre-quantized weights: omnicore's documented layout (safetensors + scales) and loading it back.

``save_quantized(pipeline, spec, directory)`` writes, for each component the model declares quantizable
(``quantization_targets``), one ``<component>.safetensors`` holding the component's whole state after
quantization, plain tensors only:

* an unquantized parameter or buffer under its state-dict name (``blocks.0.norm.weight``);
* the reference backend's quantized linear as its buffers ``<linear>.qweight`` (``I8`` or ``F8_E4M3``,
  ``[out, in]``) and ``<linear>.scale`` (``F32``, ``[out]``), and a stacked expert tensor as ``<owner>.<name>_q`` /
  ``<owner>.<name>_scale`` (``[E, out, in]`` / ``[E, out]``);
* a torchao quantized weight (a tensor subclass) as its inner tensors ``<name>.<inner>`` (torchao 0.18's
  ``Int8Tensor``: ``qdata``, ``scale``, ``zero_point``; ``Float8Tensor``: ``qdata``, ``scale``).

and ``quantization.json``: ``{"format": "omnicore-weight-only", "version": 1, "mode", "linear_backend",
"torchao_version", "components": {name: {"file", "linears", "stacked", "tensors"}}}``. The safetensors metadata
repeats ``format``, ``mode`` and ``component``.

``load_quantized(pipeline, spec, directory)`` gives a loaded (unquantized) pipeline the same module structure
(:func:`~omnicore.quantization.quantize_module` with the recorded backend) and then copies every tensor from the
files, so the weights are the file's, bit for bit, whatever the loaded values were (a checkpoint quantized
elsewhere or with other scales loads as written). A file written with another backend, mode, or torchao layout is
refused naming the difference. The plugins' loaders still read the unquantized checkpoint first: this saves the
quantization's arithmetic, not the load's peak memory (not done).

An engine finds such a directory at ``<checkpoint>/quantized/<mode>/`` (``Engine(quantization=mode)``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import InvalidRequest

if TYPE_CHECKING:
    from ..specs import ModelSpec
    from . import QuantReport

FORMAT = "omnicore-weight-only"
VERSION = 1


def _flat_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state as plain tensors (tensor subclasses split into ``<name>.<inner>``)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
            inner, _ = t.__tensor_flatten__()  # type: ignore[attr-defined, unused-ignore]
            for n in inner:
                value = getattr(t, n)
                if isinstance(value, torch.Tensor):
                    out[f"{name}.{n}"] = value.detach().contiguous()
        else:
            out[name] = t.detach().contiguous()
    return out


def _targets(pipeline: object, spec: ModelSpec) -> Mapping[str, tuple[nn.Module, tuple[str, ...]]]:
    from ..errors import UnsupportedFeature
    from ..planning.source import profile_module

    profile = profile_module(spec)
    targets_fn = getattr(profile, "quantization_targets", None) if profile is not None else None
    if targets_fn is None:
        raise UnsupportedFeature("quantization", f"model {spec.name!r} declares no quantizable modules")
    targets: Mapping[str, tuple[nn.Module, tuple[str, ...]]] = targets_fn(pipeline)
    return targets


def save_quantized(pipeline: object, spec: ModelSpec, directory: str | Path, report: Mapping[str, QuantReport]) -> Path:
    """Write a quantized pipeline's components (``report``: what :func:`apply_to_pipeline` returned) into
    ``directory`` in the layout above. Returns the directory."""
    from safetensors.torch import save_file

    from . import torchao_available

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    components: dict[str, object] = {}
    modes = {r.mode for r in report.values()}
    backends = {r.linear_backend for r in report.values()}
    if len(modes) != 1 or len(backends) != 1:
        raise InvalidRequest("quantization", f"one mode and backend per checkpoint, got {modes} / {backends}")
    mode, backend = modes.pop(), backends.pop()
    for name, (module, _patterns) in _targets(pipeline, spec).items():
        state = _flat_state(module)
        file = f"{name}.safetensors"
        save_file(state, str(out / file), metadata={"format": FORMAT, "mode": mode, "component": name})
        components[name] = {"file": file, "linears": list(report[name].linears), "stacked": list(report[name].stacked),
                            "tensors": len(state)}
    version = None
    if torchao_available() and backend == "torchao":
        from importlib.metadata import version as dist_version

        version = dist_version("torchao")
    index = {"format": FORMAT, "version": VERSION, "mode": mode, "linear_backend": backend,
             "torchao_version": version, "components": components}
    (out / "quantization.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


def read_index(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "quantization.json"
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest("quantization", f"{path}: not a pre-quantized checkpoint ({exc})") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise InvalidRequest("quantization", f"{path}: format {index.get('format')!r} version {index.get('version')!r}"
                                             f", expected {FORMAT!r} version {VERSION}")
    return dict(index)


def load_quantized(pipeline: object, spec: ModelSpec, directory: str | Path,
                   mode: str | None = None) -> dict[str, QuantReport]:
    """Quantize a loaded pipeline's declared components from ``directory`` (the file's tensors, bit for bit).
    Returns the per-component :class:`~omnicore.quantization.QuantReport`."""
    from safetensors import safe_open

    from . import quantize_module

    index = read_index(directory)
    if mode is not None and index["mode"] != mode:
        raise InvalidRequest("quantization", f"{directory} holds {index['mode']} weights, asked for {mode}")
    if index["linear_backend"] == "torchao":
        from importlib.metadata import version as dist_version

        from . import torchao_available

        if not torchao_available() or dist_version("torchao") != index.get("torchao_version"):
            have = dist_version("torchao") if torchao_available() else "not installed"
            raise InvalidRequest("quantization", f"{directory} was written by torchao {index.get('torchao_version')}"
                                                 f" (its tensor layout); torchao here: {have}")
    reports: dict[str, QuantReport] = {}
    targets = _targets(pipeline, spec)
    missing = sorted(set(index["components"]) ^ set(targets))
    if missing:
        raise InvalidRequest("quantization", f"{directory}: components {missing} differ from the model's "
                                             f"quantization targets {sorted(targets)}")
    for name, (module, patterns) in targets.items():
        entry = index["components"][name]
        report = quantize_module(module, index["mode"], patterns, backend=index["linear_backend"])
        if list(report.linears) != entry["linears"] or list(report.stacked) != entry["stacked"]:
            raise InvalidRequest("quantization", f"{directory}: {name}'s quantized weights differ from this model's "
                                                 f"({len(entry['linears'])} linears saved, {len(report.linears)} "
                                                 "here)")
        state = _flat_state(module)
        with safe_open(str(Path(directory) / entry["file"]), framework="pt") as f:
            stored = set(f.keys())
            if stored != set(state):
                diff = sorted(stored ^ set(state))[:3]
                raise InvalidRequest("quantization", f"{directory}/{entry['file']}: tensors differ from {name}'s "
                                                     f"state (e.g. {diff})")
            with torch.no_grad():
                for key, target in state.items():
                    value = f.get_tensor(key)
                    if value.shape != target.shape or value.dtype != target.dtype:
                        raise InvalidRequest("quantization", f"{entry['file']}: {key} is {value.dtype} "
                                                             f"{list(value.shape)}, the model holds {target.dtype} "
                                                             f"{list(target.shape)}")
                    target.copy_(value)
        reports[name] = report
    return reports


def find_prequantized(root: str | Path, mode: str) -> Path | None:
    """``<root>/quantized/<mode>`` when it holds a pre-quantized checkpoint."""
    path = Path(root) / "quantized" / mode
    return path if (path / "quantization.json").is_file() else None


__all__ = ["FORMAT", "VERSION", "find_prequantized", "load_quantized", "read_index", "save_quantized"]
