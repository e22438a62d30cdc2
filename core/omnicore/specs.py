"""Registry records: what a plugin registers. They are cheap to build (no heavy imports) and frozen.

Implementations are named by lazy ``"module:attr"`` paths and resolved only when used, so listing plugins
never imports torch. ``provider`` is filled in by the plugin host with the registering plugin's name.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.:\-]*$")
_PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _check_name(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: must be a lower-case name "
            f"([a-z0-9][a-z0-9_.:-]*), got {value!r}"
        )


def _check_path(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None and attribute.name != "impl":
        return
    if not isinstance(value, str) or not _PATH_RE.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: must be a lazy 'module:attr' path, got {value!r}"
        )


def resolve(path: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute."""
    module_name, _, attr_path = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


# ---------------------------------------------------------------------------------------------- models


@attrs.frozen
class ModelCapabilities:
    """What a model can do; the engine and server consult this instead of sniffing model types."""

    modes: tuple[str, ...] = ("t2i",)
    outputs: tuple[str, ...] = ("image",)  # any of "image", "video", "audio"
    max_reference_images: int = 0
    supports_batching: bool = True
    max_outputs_per_request: int = 4
    cache_methods: tuple[str, ...] = ()
    needs_packed_varlen: bool = False
    max_pixels: int | None = None  # height x width
    max_frames: int | None = None
    max_steps: int | None = None  # denoise steps per request
    max_pixel_frames: int | None = None  # height x width x frames of one output (a video's total pixels)


@attrs.frozen
class RequestDefaults:
    """Defaults a model supplies for unset request fields (the request schema has no sentinel values)."""

    height: int = 512
    width: int = 512
    num_frames: int = 1
    fps: float = 24.0
    num_inference_steps: int = 30
    guidance_scale: float = 5.0
    flow_shift: float | None = None
    negative_prompt: str | None = None


@attrs.frozen
class PresetSpec:
    """A named tiny checkpoint: ``builder(target_dir)`` writes it in the real on-disk layout."""

    name: str = attrs.field(validator=_check_name)
    builder: str = attrs.field(validator=_check_path)
    description: str = ""


@attrs.frozen
class ModelSpec:
    """A model family a plugin serves."""

    name: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_path)  # pipeline class, "module:Class"
    description: str = ""
    aliases: tuple[str, ...] = ()  # model_index.json _class_name / config.json architectures
    detect: str | None = attrs.field(default=None, validator=_check_path)  # "mod:fn(path) -> bool"
    capabilities: ModelCapabilities = ModelCapabilities()
    defaults: RequestDefaults = RequestDefaults()
    presets: tuple[PresetSpec, ...] = ()
    provider: str = ""

    def load_impl(self) -> Any:
        return resolve(self.impl)


# ---------------------------------------------------------------------------------------------- platforms


@attrs.frozen
class PlatformSpec:
    """A device platform. ``probe`` is a cheap "mod:fn" returning ``None`` when usable, else the reason it is not."""

    name: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_path)  # platform class, "module:Class"
    device_type: str = "cpu"
    priority: int = 0  # higher wins automatic selection; CPU is the floor
    probe: str | None = attrs.field(default=None, validator=_check_path)
    attention_preference: tuple[str, ...] = ()
    description: str = ""
    provider: str = ""

    def load_impl(self) -> Any:
        return resolve(self.impl)

    def unavailable_reason(self) -> str | None:
        """``None`` when the platform can run here; otherwise why it cannot."""
        if self.probe is None:
            return None
        result = resolve(self.probe)()
        return None if result is None else str(result)


# ---------------------------------------------------------------------------------------------- attention


@attrs.frozen
class AttentionCapabilities:
    """Declared properties of an attention kernel (see DESIGN §6). Undeclared means unsupported."""

    platforms: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    head_dims: tuple[int, int] = (1, 1024)  # inclusive range
    packed_varlen: bool = False  # honours cu_seqlens documents
    packed_mask_free: bool = False  # [real | pad] packing needs no mask
    sparse: bool = False
    prefix_kv_slicing: bool = False


@attrs.frozen
class AttentionRequirement:
    """What a model needs from attention at one call site; backends are matched against it."""

    platform: str = "cpu"
    dtype: str = "float32"
    head_dim: int = 64
    packed_varlen: bool = False
    packed_mask_free: bool = False
    sparse: bool = False

    def unmet_by(self, caps: AttentionCapabilities) -> list[str]:
        """Every reason ``caps`` cannot serve this requirement (empty when it can)."""
        reasons = []
        if self.platform not in caps.platforms:
            reasons.append(f"platform {self.platform!r} not in {list(caps.platforms)}")
        if self.dtype not in caps.dtypes:
            reasons.append(f"dtype {self.dtype} not in {list(caps.dtypes)}")
        lo, hi = caps.head_dims
        if not lo <= self.head_dim <= hi:
            reasons.append(f"head_dim {self.head_dim} outside [{lo}, {hi}]")
        for flag in ("packed_varlen", "packed_mask_free", "sparse"):
            if getattr(self, flag) and not getattr(caps, flag):
                reasons.append(f"{flag} not supported")
        return reasons


@attrs.frozen
class AttentionBackendSpec:
    """An attention implementation: ``impl`` is a callable with the reference signature."""

    name: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_path)
    capabilities: AttentionCapabilities = AttentionCapabilities()
    priority: int = 0
    description: str = ""
    provider: str = ""

    def load_impl(self) -> Any:
        return resolve(self.impl)


# ---------------------------------------------------------------------------------------------- caches


@attrs.frozen
class CacheMethodSpec:
    """A cache/acceleration method. ``impl`` is ``apply(pipeline, config) -> handle``."""

    name: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_path)
    conflicts: tuple[str, ...] = ()  # names that cannot be enabled together with this one
    requires: tuple[str, ...] = ()  # model capabilities it needs
    description: str = ""
    provider: str = ""

    def load_impl(self) -> Any:
        return resolve(self.impl)


SPEC_KINDS: Mapping[str, type] = {
    "model": ModelSpec,
    "platform": PlatformSpec,
    "attention_backend": AttentionBackendSpec,
    "cache_method": CacheMethodSpec,
}

RegisterFn = Callable[[Any], None]
