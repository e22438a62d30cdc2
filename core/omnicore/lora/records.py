"""The request-side LoRA records (no torch): :class:`LoRA` (one adapter on a request) and :class:`LoRATargets`
(what a model plugin declares adaptable, in its :class:`~omnicore.specs.ModelSpec`).

Both are frozen attrs records validated at construction, so a bad value fails where the request is built
(Python, CLI or HTTP) with an :class:`~omnicore.errors.InvalidRequest` naming ``loras``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from ..errors import InvalidRequest

#: most adapters one request may compose (each adds its rank to every adapted linear of the batch)
MAX_LORAS_PER_REQUEST = 8
#: largest |scale| accepted (a finite bound keeps a typo like 1e30 from producing inf/NaN latents)
MAX_LORA_SCALE = 100.0


def _check_name(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest("loras.name_or_path", f"must be a non-empty string, got {value!r}")
    if "\x00" in value:
        raise InvalidRequest("loras.name_or_path", "must not contain NUL characters")


def _to_float(value: object) -> object:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _check_scale(inst: object, attr: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
        raise InvalidRequest("loras.scale", f"must be a finite number, got {value!r}")
    if abs(value) > MAX_LORA_SCALE:
        raise InvalidRequest("loras.scale", f"must be between -{MAX_LORA_SCALE:g} and {MAX_LORA_SCALE:g}, got {value}")


@attrs.frozen
class LoRA:
    """One adapter on a request: ``name_or_path`` is a name the server preloaded (``--lora-modules name=path``) or
    a path under one of the allowed LoRA directories (``--lora-dir``); ``scale`` multiplies its delta
    (``scale * (x A^T) B^T``, on top of the adapter's own ``alpha / r``). Scale 0 is exactly no adapter."""

    name_or_path: str = attrs.field(validator=_check_name)
    scale: float = attrs.field(default=1.0, converter=_to_float, validator=_check_scale)

    @classmethod
    def parse(cls, text: str) -> LoRA:
        """``NAME_OR_PATH[:SCALE]`` (the CLI form): a trailing ``:number`` is the scale, anything else is the name
        (so ``C:\\a`` or ``./a:b`` stay names)."""
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                return cls(head, float(tail))
            except ValueError:
                pass
        return cls(text)


def as_loras(value: object) -> tuple[LoRA, ...]:
    """The request field's converter: ``None``, one :class:`LoRA`/str, or a sequence of them -> a tuple of LoRA
    (strings become ``LoRA(s)``); more than :data:`MAX_LORAS_PER_REQUEST` or another type is an InvalidRequest."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, (LoRA, str)) else value
    if not isinstance(items, (list, tuple)):
        raise InvalidRequest("loras", f"must be a list of LoRA(name_or_path, scale), got {type(value).__name__}")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = LoRA(item)
        if not isinstance(item, LoRA):
            raise InvalidRequest(f"loras[{i}]", f"must be a LoRA(name_or_path, scale), got {type(item).__name__}")
        out.append(item)
    if len(out) > MAX_LORAS_PER_REQUEST:
        raise InvalidRequest("loras", f"at most {MAX_LORAS_PER_REQUEST} adapters per request, got {len(out)}")
    return tuple(out)


def _patterns(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _pairs(value: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple((str(a), str(b)) for a, b in value)


DEFAULT_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.")
DEFAULT_KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")


@attrs.frozen
class LoRATargets:
    """The adaptable linears of a model (its spec's ``lora`` field).

    ``root`` is the pipeline attribute (dotted) holding the adapted network, e.g. ``"transformer"``; ``modules``
    are ``fnmatch`` patterns over the qualified names of its ``nn.Linear`` modules that an adapter may target (an
    adapter naming any other module is refused). ``adaln`` are the patterns of the AdaLN projections the
    ``adaln_schedule`` cache precomputes: adapters on them are refused while that cache is on (its tables are
    keyed by timesteps only). Keys of adapter files are module names after stripping one of ``prefixes``
    (PEFT's ``base_model.model.``, diffusers' ``transformer.``, ...), then rewriting ``aliases`` (``(theirs,
    ours)`` name prefixes, for adapters trained on an implementation that names modules differently); kohya /
    A1111 files use one of ``kohya_prefixes`` and the module name with ``_`` for ``.``.

    ``converter`` (``"module:function"``, imported on first use) handles layouts a rename cannot: it receives
    ``{module: (A [r, in], B [out, r])}`` host float32 tensors of a PEFT/diffusers adapter in the adapter's own
    names (prefix stripped, aliases applied, ``alpha / r`` already folded into ``B``) and the network's ``config``,
    and returns them in the model's names — e.g. separate ``to_q/to_k/to_v`` adapters as one fused ``qkv_proj``
    adapter (ranks concatenated, ``B`` block-diagonal: exact). Names it leaves alone must already be the model's.
    Kohya / A1111 files go through it too: their flattened keys (``lora_unet_transformer_blocks_0_attn_to_q``) are
    read back to the dotted names it takes, which ``kohya_names`` (``"module:function"``, called with the model's
    adaptable module names and the network's ``config``) lists beyond the model's own (a flattened name alone
    cannot tell ``attn_to_q`` from ``attn.to_q``).
    """

    modules: tuple[str, ...] = attrs.field(converter=_patterns)
    root: str = "transformer"
    adaln: tuple[str, ...] = attrs.field(default=(), converter=_patterns)
    prefixes: tuple[str, ...] = attrs.field(default=DEFAULT_PREFIXES, converter=_patterns)
    kohya_prefixes: tuple[str, ...] = attrs.field(default=DEFAULT_KOHYA_PREFIXES, converter=_patterns)
    aliases: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_pairs)
    converter: str | None = None
    kohya_names: str | None = None

    def __attrs_post_init__(self) -> None:
        if not self.modules:
            raise ValueError("LoRATargets.modules must name at least one module pattern")
        if not self.root or any(not part.isidentifier() for part in self.root.split(".")):
            raise ValueError(f"LoRATargets.root must be a dotted attribute path, got {self.root!r}")


__all__ = ["MAX_LORAS_PER_REQUEST", "MAX_LORA_SCALE", "LoRA", "LoRATargets", "as_loras"]
