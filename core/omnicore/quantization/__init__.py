"""Weight-only quantization (``--quantization int8|fp8``, ``Engine(quantization=...)``).

Each selected weight ``W [out, in]`` is stored as one byte per element plus one float32 scale per output row
(per-output-channel, symmetric): ``s = max|W_row| / qmax`` with ``qmax`` = 127 (int8) or 448 (fp8 e4m3), ``Q =
round(W / s)`` (int8, clamped to ±127) or ``(W / s).to(float8_e4m3fn)``; the forward uses ``Q * s`` cast to the
activation dtype. Only the weights a model names are touched (the linears of its DiT blocks and text encoder,
and stacked expert tensors ``[E, out, in]``); norms, embeddings, final layers and AdaLN projections never are, so
the AdaLN schedule cache builds its tables from the exact projection.

Two implementations of the same math:

* ``torchao`` (preferred for ``nn.Linear`` when installed: ``quantize_`` with ``Int8WeightOnlyConfig`` /
  ``Float8WeightOnlyConfig``, which have CPU paths);
* ``reference`` (:class:`WeightOnlyLinear`, :func:`quantize_stacked_`): plain torch, used for stacked expert
  tensors always and for linears when torchao is absent or ``backend="reference"``.

**FP8 matmul.** ``--quantization fp8`` on a CUDA device with FP8 tensor cores (compute capability 8.9 or newer:
Ada, Hopper, Blackwell; :func:`fp8_matmul_available`) uses the reference linears with ``fast_fp8=True``: each
forward quantizes its activations to e4m3 with one dynamic scale per row and multiplies with
``torch._scaled_mm`` (row-wise scales for both operands, output in the activation dtype), instead of
dequantizing the weight. Shapes ``_scaled_mm`` does not take (dims not multiples of 16) fall back to the
dequantizing path. Weight bytes are the same as the other fp8 backends'. This path is **unverified here**: no
GPU has run it (the selection and the fallbacks are tested on CPU).
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidRequest

MODES = ("int8", "fp8")
BACKENDS = ("auto", "torchao", "reference")
_QMAX = {"int8": 127.0, "fp8": 448.0}


def check_mode(mode: str | None) -> str | None:
    """``None``/``"none"`` -> ``None``; else one of :data:`MODES` (a clear error naming ``quantization``)."""
    if mode in (None, "none"):
        return None
    if mode not in MODES:
        raise InvalidRequest("quantization", f"must be one of {['none', *MODES]}, got {mode!r}")
    return mode


def quantize_tensor(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, scale)`` of ``w [..., out, in]``: per-output-row symmetric scales (float32, shape ``[..., out]``)."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=-1).clamp(min=1e-12) / _QMAX[mode]
    scaled = wf / scale[..., None]
    if mode == "int8":
        return scaled.round().clamp(-127, 127).to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


class WeightOnlyLinear(nn.Module):
    """An ``nn.Linear`` whose weight is int8 or fp8 with float32 per-row scales, dequantized in ``forward``."""

    def __init__(self, linear: nn.Linear, mode: str, *, fast_fp8: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.mode = linear.in_features, linear.out_features, mode
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        q, scale = quantize_tensor(linear.weight, mode)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.compute_dtype = linear.weight.dtype
        self.fast_fp8 = fast_fp8

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (what the forward multiplies by; for code that reads ``.weight``)."""
        return dequantize(self.qweight, self.scale, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_fp8 and self.mode == "fp8" and x.is_cuda and scaled_mm_shapes_ok(x, self.qweight):
            return _scaled_mm_fp8(x, self.qweight, self.scale, self.bias)  # pragma: no cover - needs an FP8 GPU
        return F.linear(x, dequantize(self.qweight, self.scale, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def scaled_mm_shapes_ok(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` takes this activation and weight: inner and output dims multiples of 16."""
    return x.shape[-1] % 16 == 0 and q.shape[0] % 16 == 0 and q.shape[1] == x.shape[-1]


def fp8_matmul_available(device: Any) -> bool:
    """Whether ``device`` runs the dynamic-activation FP8 matmul: a CUDA device of compute capability 8.9 or
    newer (FP8 tensor cores) with a torch that has ``torch._scaled_mm``."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    try:
        return tuple(torch.cuda.get_device_capability(dev)) >= (8, 9)
    except (RuntimeError, AssertionError):  # no CUDA driver / device
        return False


def linear_choice(mode: str, device: Any, backend: str = "auto") -> tuple[str, bool]:
    """``(backend, fast_fp8)`` for the linears of a model quantized as ``mode`` on ``device``: fp8 on an FP8 GPU
    takes the reference linears with the ``_scaled_mm`` matmul (unless ``backend="torchao"`` is asked for);
    everything else keeps ``backend``."""
    if mode == "fp8" and backend in ("auto", "reference") and fp8_matmul_available(device):
        return "reference", True
    return backend, False


def _scaled_mm_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:  # pragma: no cover - unverified on GPU
    """Dynamic-activation FP8 matmul: per-row activation scales, the weight's per-row scales (cuBLASLt)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xs = x2.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    xq = (x2.float() / xs).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale[None, :].float(), out_dtype=x.dtype,
                           bias=bias.to(x.dtype) if bias is not None else None)
    return out.reshape(*shape[:-1], q.shape[0])


class _StackView:
    """Stands in for a stacked ``[E, out, in]`` parameter: ``view[e]`` is expert ``e``'s dequantized weight. The
    int8/fp8 data and scales are buffers of the owning module (so ``.to()`` and state dicts see them)."""

    def __init__(self, module: nn.Module, name: str, dtype: torch.dtype) -> None:
        self._module = weakref.ref(module)
        self._name, self.dtype = name, dtype

    def _parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        module = self._module()
        assert module is not None
        return getattr(module, f"{self._name}_q"), getattr(module, f"{self._name}_scale")

    @property
    def shape(self) -> torch.Size:
        return self._parts()[0].shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        q, s = self._parts()
        return dequantize(q[index], s[index], self.dtype)


def quantize_stacked_(module: nn.Module, name: str, mode: str) -> None:
    """Replace ``module.<name>`` (a parameter ``[E, out, in]``) by int8/fp8 buffers and a dequantizing view."""
    param = getattr(module, name)
    q, scale = quantize_tensor(param, mode)
    dtype = param.dtype
    del module._parameters[name]
    module.register_buffer(f"{name}_q", q)
    module.register_buffer(f"{name}_scale", scale)
    object.__setattr__(module, name, _StackView(module, name, dtype))


@attrs.frozen
class QuantReport:
    """What :func:`quantize_module` did: the mode, the backend per weight kind and the weights replaced."""

    mode: str
    linear_backend: str
    linears: tuple[str, ...]
    stacked: tuple[str, ...]
    fast_fp8: bool = False  # the fp8 linears multiply with torch._scaled_mm (dynamic activation scales)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "linear_backend": self.linear_backend, "linears": len(self.linears),
                "stacked": len(self.stacked), "fast_fp8": self.fast_fp8}


def _import_torchao() -> Any:
    """``torchao.quantization``, imported with its load-time chatter (missing CUDA extension libraries on a CPU
    build, torch's pytree deprecation notices) kept out of the CLI's output unless ``--verbose`` logging asks."""
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(logging.ERROR, lg.level))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.quantization as tq
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return tq


def _torchao_config(mode: str) -> Any:
    tq = _import_torchao()
    return tq.Int8WeightOnlyConfig() if mode == "int8" else tq.Float8WeightOnlyConfig()


def torchao_available() -> bool:
    """Whether torchao is installed (found without importing it: its import is slow and chatty)."""
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def library_quantized(t: Any) -> bool:
    """Whether ``t`` is already a torchao quantized tensor (a component diffusers or transformers loaded from a
    ``TorchAoConfig`` checkpoint): such a weight keeps the quantization it was saved with."""
    return type(t).__module__.split(".")[0] == "torchao"


def select(module: nn.Module, patterns: Iterable[str]) -> tuple[list[str], list[tuple[nn.Module, str, str]]]:
    """Names of the matching ``nn.Linear`` modules, and ``(owner, leaf, full name)`` of matching stacked
    parameters (two or more dims, not a Linear's weight). A linear whose weight is already quantized
    (:func:`library_quantized`) is left out: it is not quantized twice."""
    pats = tuple(patterns)
    linears, stacked = [], []
    for mod_name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            if library_quantized(sub.weight):
                continue
            if any(fnmatch.fnmatchcase(mod_name, p) for p in pats):
                linears.append(mod_name)
            continue
        for leaf, p in sub.named_parameters(recurse=False):
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            if p.dim() >= 2 and any(fnmatch.fnmatchcase(full, pat) for pat in pats):
                stacked.append((sub, leaf, full))
    return linears, stacked


def _is_dtensor(t: Any) -> bool:
    from ..parallel.local_linear import is_dtensor

    return is_dtensor(t)


def quantize_module(module: nn.Module, mode: str, patterns: Iterable[str], *, backend: str = "auto",
                    fast_fp8: bool = False) -> QuantReport:
    """Quantize, in place, the linears and stacked weights of ``module`` that ``patterns`` name.

    A tensor-parallel linear (its weight a DTensor, after :func:`omnicore.parallel.tensor_parallel.parallelize`)
    becomes a :class:`~omnicore.parallel.local_linear.ShardedLinear` first: its local shard is quantized by the
    same code as a whole linear (at ``<name>.local``), and the row layers' all-reduce stays around it."""
    mode = check_mode(mode) or ""
    if not mode:
        raise InvalidRequest("quantization", "quantize_module needs int8 or fp8")
    if backend not in BACKENDS:
        raise InvalidRequest("quantization_backend", f"must be one of {list(BACKENDS)}, got {backend!r}")
    linears, stacked = select(module, patterns)
    if any(_is_dtensor(module.get_submodule(n).weight) for n in linears):  # tensor-parallel shards: plain again
        from ..parallel.local_linear import localize_named

        moved = localize_named(module, linears)
        linears = [moved.get(n, n) for n in linears]
    use_torchao = backend == "torchao" or (backend == "auto" and torchao_available() and not fast_fp8)
    if backend == "torchao" and not torchao_available():
        raise InvalidRequest("quantization_backend", "torchao is not installed (pip install torchao)")
    if linears and use_torchao:
        chosen = set(linears)
        _import_torchao().quantize_(module, _torchao_config(mode), filter_fn=lambda m, fqn: fqn in chosen)
    elif linears:
        for name in linears:
            parent_name, _, leaf = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, leaf, WeightOnlyLinear(getattr(parent, leaf), mode, fast_fp8=fast_fp8))
    for owner, leaf, _ in stacked:
        quantize_stacked_(owner, leaf, mode)
    return QuantReport(mode=mode, linear_backend="torchao" if use_torchao else "reference",
                       linears=tuple(linears), stacked=tuple(full for _, _, full in stacked),
                       fast_fp8=bool(fast_fp8 and linears and not use_torchao and mode == "fp8"))


def resident_bytes(module: nn.Module) -> int:
    """Bytes the module's parameters and buffers occupy, looking inside tensor subclasses (torchao's quantized
    tensors hold their int8/fp8 data and scales as inner tensors)."""
    seen: set[int] = set()

    def size(t: torch.Tensor) -> int:
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
            names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
            inner = [getattr(t, n) for n in names]  # a DTensor also names its mesh: only tensors hold bytes
            return sum(size(x) for x in inner if isinstance(x, torch.Tensor))
        if id(t) in seen:
            return 0
        seen.add(id(t))
        return t.numel() * t.element_size()

    return sum(size(t) for t in [*module.parameters(), *module.buffers()])


def quantize_pipeline(pipeline: Any, targets: Mapping[str, tuple[nn.Module, tuple[str, ...]]], mode: str, *,
                      backend: str = "auto", device: Any = None) -> dict[str, QuantReport]:
    """Quantize each ``targets`` entry (component name -> (module, patterns)) of a loaded pipeline; on an FP8
    ``device`` fp8 linears take the ``_scaled_mm`` matmul (:func:`linear_choice`)."""
    backend, fast = linear_choice(mode, device, backend)
    return {name: quantize_module(module, mode, patterns, backend=backend, fast_fp8=fast)
            for name, (module, patterns) in targets.items()}


def apply_to_pipeline(pipeline: Any, spec: Any, mode: str, *, backend: str = "auto",
                      root: Any = None, device: Any = None) -> dict[str, QuantReport]:
    """Quantize a loaded pipeline with the targets its model plugin declares (``quantization_targets(pipeline)``
    in the module of its presets, next to the planner's ``QUANTIZABLE``); a model declaring none is refused.
    A checkpoint ``root`` holding ``quantized/<mode>/`` (:mod:`.checkpoint`) gives the weights from there.
    ``device``: where the pipeline runs (default: its ``device`` attribute), for :func:`linear_choice`."""
    from ..errors import UnsupportedFeature
    from ..planning.source import profile_module

    if root is not None:
        from .checkpoint import find_prequantized, load_quantized

        stored = find_prequantized(root, mode)
        if stored is not None:
            return load_quantized(pipeline, spec, stored, mode)

    profile = profile_module(spec)
    targets_fn = getattr(profile, "quantization_targets", None) if profile is not None else None
    if targets_fn is None:
        raise UnsupportedFeature("quantization", f"model {spec.name!r} declares no quantizable modules")
    return quantize_pipeline(pipeline, targets_fn(pipeline), mode, backend=backend,
                             device=device if device is not None else getattr(pipeline, "device", None))


_OVERHEAD: dict[tuple[str, str], int] = {}


def row_overhead(mode: str, *, stacked: bool = False, backend: str = "auto") -> int:
    """Bytes per output row beyond the 1-byte elements, as the backend the engine would pick stores them. Ours
    keeps a float32 scale (4 bytes); torchao's layouts differ between versions (0.18's int8 adds a 1-byte zero
    point, 0.17's more), so its overhead is measured once by quantizing a small probe linear."""
    linear_torchao = backend == "torchao" or (backend == "auto" and torchao_available())
    if stacked or not linear_torchao:
        return 4
    key = (mode, "torchao")
    if key not in _OVERHEAD:
        rows, cols = 64, 32
        probe = nn.Sequential(nn.Linear(cols, rows, bias=False))
        quantize_module(probe, mode, ["0"], backend="torchao")
        _OVERHEAD[key] = (resident_bytes(probe) - rows * cols) // rows
    return _OVERHEAD[key]
