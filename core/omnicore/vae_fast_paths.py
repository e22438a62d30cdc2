"""Request-gated VAE fast paths and the VAE decode precision (docs/contracts-status.md C7).

A model plugin installs fast versions of some VAE modules (fused GroupNorm+SiLU, fused Wan RMSNorm+SiLU ...,
usually calling ``options.platform.ops``) with :func:`install_fast_path`. Each VAE carries one
:class:`FastPathGate`, off by default: with the gate off every installed module runs its original forward, so the
decode is bit-exact to the unmodified VAE; with it on the fast forward runs (approximate within the kernel's
tolerance). The engine's batch runner enters :func:`request_fast_paths` around each batch: the gate of
``pipeline.vae`` (and of anything ``pipeline.fast_path_gates()`` returns) is on **iff** the batch's requests ask
for ``quality == "high"`` (the scheduler never batches two quality levels together). Gates nest: leaving restores
the previous state.

Installation adds no parameter, buffer or submodule (parameter names and the state dict are unchanged) and is
idempotent. While ``torch.compile`` traces, installed modules always take their original forward.

:func:`apply_decode_precision` casts only the decoder side of a VAE (``decoder`` and ``post_quant_conv``) to the
``vae_decode_precision`` dtype and feeds it latents in that dtype; the encoder side stays as loaded.
Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

from .errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

#: a module's forward arguments, as a forward pre-hook with ``with_kwargs=True`` sees and returns them
ForwardArgs = tuple[tuple[object, ...], dict[str, object]]

_GATE_ATTR = "_omnicore_fast_path_gate"
_INSTALLED_ATTR = "_omnicore_fast_path"
_PRECISION_ATTR = "_omnicore_decode_precision"
FAST_QUALITY = "high"

VAE_DECODE_PRECISIONS = ("fp32", "fp16", "bf16")


def check_vae_decode_precision(value: object) -> str | None:
    """``fp32``/``fp16``/``bf16`` or ``None`` (the model's own choice); anything else is a ConfigError.

    The one rule for ``vae_decode_precision`` (``LoadOptions``, ``--vae-decode-precision``, :func:`decode_dtype`)."""
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in VAE_DECODE_PRECISIONS:
        # the message shape of docs/contracts-status.md C7.4: "must be one of {'fp32', 'fp16', 'bf16'} or None, got ..."
        choices = ", ".join(repr(p) for p in VAE_DECODE_PRECISIONS)
        raise ConfigError("vae_decode_precision", f"must be one of {{{choices}}} or None, got {value!r}")
    return value.lower()


class FastPathGate:
    """On/off switch of one VAE's fast paths (``enabled`` is False until a gate context turns it on).

    Toggled by the engine's worker around each batch (a plain attribute: copies and pickles of the VAE keep it)."""

    def __init__(self) -> None:
        self.enabled = False

    def __repr__(self) -> str:
        return f"FastPathGate(enabled={self.enabled})"

    @contextlib.contextmanager
    def __call__(self, enabled: bool) -> Iterator[FastPathGate]:
        """Set the gate for the ``with`` body and restore the previous state on exit (nesting works)."""
        previous, self.enabled = self.enabled, bool(enabled)
        try:
            yield self
        finally:
            self.enabled = previous


@overload
def fast_path_gate(owner: object, *, create: Literal[True] = True) -> FastPathGate: ...
@overload
def fast_path_gate(owner: object, *, create: bool) -> FastPathGate | None: ...
def fast_path_gate(owner: object, *, create: bool = True) -> FastPathGate | None:
    """The gate registered on ``owner`` (a VAE), made on first use unless ``create`` is False."""
    gate = owner.__dict__.get(_GATE_ATTR) if hasattr(owner, "__dict__") else None
    if gate is None and create:
        gate = FastPathGate()
        object.__setattr__(owner, _GATE_ATTR, gate)  # a plain attribute: never a submodule or state-dict entry
    return gate


def _compiling() -> bool:
    import torch

    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and getattr(compiler, "is_compiling", lambda: False)())


def _gated_forward(self: nn.Module, *args: object, **kwargs: object) -> object:
    original, fast_forward, gate = self.__dict__[_INSTALLED_ATTR]
    if gate.enabled and not _compiling():
        return fast_forward(*args, **kwargs)
    return original(*args, **kwargs) if original is not None else type(self).forward(self, *args, **kwargs)


def install_fast_path(module: nn.Module, fast_forward: Callable[..., object], gate: FastPathGate) -> None:
    """Make ``module`` run ``fast_forward(*args, **kwargs)`` while ``gate`` is on, its own forward otherwise.

    Idempotent (installing again replaces the fast forward and the gate; the original forward is kept once). The
    module's class ``forward`` is the original unless the instance had its own. A copy of the module keeps the
    switch, but ``fast_forward`` still refers to whatever it closed over: install again on a copy.
    """
    installed = module.__dict__.get(_INSTALLED_ATTR)
    original = installed[0] if installed is not None else module.__dict__.get("forward")
    object.__setattr__(module, _INSTALLED_ATTR, (original, fast_forward, gate))
    object.__setattr__(module, "forward", types.MethodType(_gated_forward, module))


def uninstall_fast_path(module: nn.Module) -> None:
    """Give ``module`` back its own forward."""
    installed = module.__dict__.pop(_INSTALLED_ATTR, None)
    if installed is not None:
        module.__dict__.pop("forward", None)
        if installed[0] is not None:
            object.__setattr__(module, "forward", installed[0])


def pipeline_gates(pipeline: object) -> list[FastPathGate]:
    """The gates of ``pipeline.vae`` (when one was registered) and of ``pipeline.fast_path_gates()``."""
    gates: list[FastPathGate] = []
    vae = getattr(pipeline, "vae", None)
    if vae is not None:
        gate = fast_path_gate(vae, create=False)
        if gate is not None:
            gates.append(gate)
    extra = getattr(pipeline, "fast_path_gates", None)
    if callable(extra):
        gates.extend(g for g in extra() if g not in gates)
    return gates


@contextlib.contextmanager
def request_fast_paths(pipeline: object, qualities: str | Iterable[str | None] | None) -> Iterator[bool]:
    """Around one batch: every gate of ``pipeline`` on iff the batch's quality is ``"high"``; yields that.

    ``qualities`` is the batch's quality or the set of its requests' qualities: one level, since the engine's
    scheduler never batches two together (a set with any other level leaves the gates off)."""
    levels = {qualities} if qualities is None or isinstance(qualities, str) else set(qualities)
    enabled = levels == {FAST_QUALITY}
    gates = pipeline_gates(pipeline)
    with contextlib.ExitStack() as stack:
        for gate in gates:
            stack.enter_context(gate(enabled))
        yield enabled


# ---------------------------------------------------------------------------------------------- decode precision
DECODER_PARTS = ("post_quant_conv", "decoder")
ENCODER_PARTS = ("encoder",)


def decode_dtype(precision: str | None) -> torch.dtype | None:
    """The torch dtype of a ``vae_decode_precision`` value (``None`` -> ``None``: keep the VAE's dtype).

    Invalid values are rejected by the core's check (the same rule as ``LoadOptions.vae_decode_precision``)."""
    import torch

    value = check_vae_decode_precision(precision)
    return None if value is None else {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[value]


def _input_cast(dtype: torch.dtype) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], ForwardArgs]:
    def cast_inputs(_module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> ForwardArgs:
        def cast(a: Any) -> Any:  # a tensor, or any argument passed through
            return a.to(dtype) if hasattr(a, "is_floating_point") and a.is_floating_point() else a

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return cast_inputs


def apply_decode_precision(vae: nn.Module, precision: str | None, parts: tuple[str, ...] = DECODER_PARTS,
                           encoder_parts: tuple[str, ...] = ENCODER_PARTS) -> torch.dtype | None:
    """Cast the decoder side of ``vae`` (its ``parts`` that exist) to ``precision`` and cast the latents entering
    the first of them to that dtype, so ``decode`` of fp32 latents runs and returns in the decode dtype. The
    encoder side keeps its dtype and casts what enters it to that dtype (a bf16 image encodes to latents of the
    encoder's dtype). ``None`` changes nothing. Returns the dtype used.

    Applying again replaces the previous setting (one input cast per part, never two)."""
    dtype = decode_dtype(precision)
    for handle in vae.__dict__.pop(_PRECISION_ATTR, ()):
        handle.remove()
    if dtype is None:
        return None
    present = [getattr(vae, name) for name in parts if getattr(vae, name, None) is not None]
    if not present:
        raise AttributeError(f"{type(vae).__name__} has none of the decoder parts {parts}")
    for module in present:
        module.to(dtype)
    handles = [present[0].register_forward_pre_hook(_input_cast(dtype), with_kwargs=True)]
    for name in encoder_parts:
        encoder = getattr(vae, name, None)
        first = next(encoder.parameters(), None) if encoder is not None else None
        if encoder is not None and first is not None:
            handles.append(encoder.register_forward_pre_hook(_input_cast(first.dtype), with_kwargs=True))
    object.__setattr__(vae, _PRECISION_ATTR, tuple(handles))
    return dtype


__all__ = [
    "FAST_QUALITY", "FastPathGate", "apply_decode_precision", "decode_dtype", "fast_path_gate", "install_fast_path",
    "pipeline_gates", "request_fast_paths", "uninstall_fast_path",
]
