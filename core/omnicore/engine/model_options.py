"""Model options: deployment-level settings a model declares (:class:`omnicore.specs.ModelOption`), checked at load.

``resolve_model_options(spec, given)`` returns every declared option with a value (the default where none was
given). Strings (from ``--model-option KEY=VALUE``) are converted to the declared type; unknown names and bad
values are a :class:`~omnicore.errors.ConfigError` naming ``model_options.<name>`` and listing what is allowed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping

from ..errors import ConfigError
from ..specs import ModelOption, ModelSpec
from ..vae_fast_paths import VAE_DECODE_PRECISIONS, check_vae_decode_precision

#: what a declared option holds once resolved (``ModelOption.type``: bool, int, float, path or str; or unset)
OptionValue = bool | int | float | str | None

__all__ = ["OptionValue", "VAE_DECODE_PRECISIONS", "check_vae_decode_precision", "coerce_option", "parse_option_args",
           "resolve_model_options"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _name(option: ModelOption) -> str:
    return f"model_options.{option.name}"


def coerce_option(option: ModelOption, value: object) -> OptionValue:
    """``value`` as the option's type (strings are parsed), checked against ``choices``."""
    name, kind = _name(option), option.type
    if value is None:
        return None
    text = value.strip() if isinstance(value, str) else None
    try:
        if kind == "bool":
            if isinstance(value, bool):
                out: OptionValue = value
            elif text is not None and text.lower() in _TRUE + _FALSE:
                out = text.lower() in _TRUE
            else:
                raise ValueError
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError
            out = int(value)
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
        elif kind == "path":
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise ValueError
            out = os.fspath(value)
        else:  # str
            if not isinstance(value, str):
                raise ValueError
            out = value
    except (TypeError, ValueError):
        raise ConfigError(name, f"must be {'a boolean (true/false)' if kind == 'bool' else f'of type {kind}'}, "
                                f"got {value!r}") from None
    if option.choices is not None and out not in option.choices:
        raise ConfigError(name, f"must be one of {', '.join(map(repr, option.choices))}, got {value!r}")
    return out


def resolve_model_options(spec: ModelSpec, given: Mapping[str, object] | None) -> dict[str, OptionValue]:
    """Every option ``spec`` declares, with the given value (converted, checked) or its default."""
    declared = {o.name: o for o in spec.options}
    given = dict(given or {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        allowed = ", ".join(sorted(declared)) or "none (it declares no options)"
        raise ConfigError(f"model_options.{unknown[0]}", f"model {spec.name} has no option {unknown[0]!r}; "
                                                         f"its options: {allowed}")
    return {name: coerce_option(o, given[name]) if name in given else o.default for name, o in declared.items()}


def parse_option_args(items: Iterable[str]) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` (from ``--model-option``) -> ``{KEY: VALUE}``; values stay strings until the
    model's declared types convert them at load."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError("--model-option", f"expected KEY=VALUE, got {item!r}")
        if key in out:
            raise ConfigError(f"model_options.{key}", "given more than once")
        out[key] = value
    return out
