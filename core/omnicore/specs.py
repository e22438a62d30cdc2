"""Registry records: what a plugin registers. They are cheap to build (no heavy imports) and frozen.

Implementations are named by lazy ``"module:attr"`` paths and resolved only when used, so listing plugins
never imports torch. ``provider`` is filled in by the plugin host with the registering plugin's name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ._lazy import resolve
from .lora.records import LoRATargets
from .ops.names import OP_NAMES  # the op vocabulary: a leaf with no imports (the op tables of ops/ sit above)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .engine.protocol import Pipeline
    from .hookspecs import CacheHandle

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.:\-]*$")
_PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _check_name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: must be a lower-case name "
            f"([a-z0-9][a-z0-9_.:-]*), got {value!r}"
        )


def _check_path(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None and attribute.name != "impl":
        return
    if not isinstance(value, str) or not _PATH_RE.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: must be a lazy 'module:attr' path, got {value!r}"
        )


def lazy_paths(spec: object) -> list[tuple[str, str]]:
    """``(field, "module:attr")`` for every lazy implementation path a spec record holds (the fields checked as
    paths: a pipeline or platform class, a detector, a probe, an op's ``applies``, a preset's builder ...), so
    ``omnicore plugins --check`` can import each one before a request needs it."""
    kind = type(spec)
    if not attrs.has(kind):
        return []
    return [(f.name, value) for f in attrs.fields(kind)
            if f.validator is _check_path and isinstance(value := getattr(spec, f.name), str)]


# ---------------------------------------------------------------------------------------------- models


MEDIA_KINDS = ("image", "video", "audio")
#: Roles the core names; a plugin may declare any other lower-case role in its spec.
STANDARD_ROLES = ("first_frame", "last_frame", "reference", "edit_source")


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _check_kinds(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    bad = [k for k in value if k not in MEDIA_KINDS]
    if not value or bad:
        raise ValueError(f"InputRole.kinds: must be a non-empty subset of {list(MEDIA_KINDS)}, got {list(value)}")


@attrs.frozen
class InputRole:
    """A conditioning role a model accepts: which media kinds fill it and how many (``max_count``).

    ``max_duration_s`` / ``min_duration_s`` bound video and audio inputs of this role (checked before dispatch).
    For a request that gives media without a role (``images=...``), the model's first declared role accepting
    that kind is used, so declare the default role of each kind first.
    """

    role: str = attrs.field(validator=_check_name)
    kinds: tuple[str, ...] = attrs.field(converter=_str_tuple, validator=_check_kinds)
    max_count: int = 1
    description: str = ""
    max_duration_s: float | None = None
    min_duration_s: float | None = None
    # the model's modes that use this role (so a deployment serving none of them can say so up front); (): any
    modes: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)

    def to_json(self) -> dict[str, object]:
        return {"role": self.role, "kinds": list(self.kinds), "max_count": self.max_count,
                "description": self.description, "max_duration_s": self.max_duration_s,
                "min_duration_s": self.min_duration_s}


@attrs.frozen
class ModelCapabilities:
    """What a model can do; the engine and server consult this instead of sniffing model types.

    ``inputs`` declares the conditioning roles (see :class:`InputRole`) and ``max_inputs`` caps their total;
    a model that declares no roles but ``max_reference_images > 0`` accepts that many ``reference`` images.
    The size/frame fields describe the model's limits for clients (``/v1/models``) and the engine's check.
    """

    modes: tuple[str, ...] = ("t2i",)
    outputs: tuple[str, ...] = ("image",)  # any of "image", "video", "audio"
    max_reference_images: int = 0
    supports_batching: bool = True
    max_outputs_per_request: int = 4
    cache_methods: tuple[str, ...] = ()
    needs_packed_varlen: bool = False  # checked before weights load: the platform must have a packed backend
    # False: the model does not run attention through LoadOptions.attention (none, or its own kernels), so a
    # forced backend (--attention-backend) is refused for it instead of being silently ignored
    honours_attention_backend: bool = True
    inputs: tuple[InputRole, ...] = ()
    max_inputs: int | None = None
    size_multiple_of: int | None = None  # height and width must be multiples of this
    max_pixels: int | None = None  # height x width
    fps_range: tuple[float, float] | None = None  # inclusive
    max_frames: int | None = None
    frame_rule: str | None = None  # for clients, e.g. "4n+1"
    max_steps: int | None = None  # denoise steps per request
    max_pixel_frames: int | None = None  # height x width x frames of one output (a video's total pixels)
    # parallel dimensions the pipeline implements over a worker group (``--parallel``): "cfg", "ulysses"
    parallel: tuple[str, ...] = ()
    # the pipeline exports and imports one request's step state (``export_step_state`` / ``import_step_state``,
    # see omnicore.engine.step_checkpoint), so a re-claimed job resumes from a step checkpoint (--checkpoint-every)
    checkpointable: bool = False

    def input_roles(self) -> tuple[InputRole, ...]:
        """The declared roles, or the legacy ``max_reference_images`` as one ``reference`` image role."""
        if self.inputs:
            return self.inputs
        if self.max_reference_images > 0:
            return (InputRole("reference", ("image",), self.max_reference_images, "reference images"),)
        return ()

    def default_role(self, kind: str) -> InputRole | None:
        """The role media of ``kind`` gets when the request names none: the first declared role taking it."""
        return next((r for r in self.input_roles() if kind in r.kinds), None)


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
    seed: int | None = None  # None: the engine draws a random seed for a request that sets none

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


@attrs.frozen
class PresetSpec:
    """A named tiny checkpoint: ``builder(target_dir)`` writes it in the real on-disk layout.

    ``defaults`` (optional) replaces the model's request defaults when this preset is loaded, e.g. small sizes
    and few steps so a tiny preset answers in seconds; build it with ``attrs.evolve(model_defaults, ...)``.
    """

    name: str = attrs.field(validator=_check_name)
    builder: str = attrs.field(validator=_check_path)
    description: str = ""
    defaults: RequestDefaults | None = None
    # the model's modes this checkpoint serves (e.g. one partition of a model); None: all of them
    modes: tuple[str, ...] | None = attrs.field(default=None, converter=lambda v: None if v is None else tuple(v))


OPTION_TYPES = ("str", "int", "float", "bool", "path")


def _check_option_type(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in OPTION_TYPES:
        raise ValueError(f"ModelOption.type: must be one of {list(OPTION_TYPES)}, got {value!r}")


@attrs.frozen
class ModelOption:
    """A deployment-level option of a model (set once per loaded model, not per request).

    Values are checked at load by :func:`omnicore.engine.model_options.resolve_model_options`: the type, and
    ``choices`` when given. ``None`` as ``default`` means "unset" (the model decides).
    """

    name: str = attrs.field(validator=_check_name)
    type: str = attrs.field(default="str", validator=_check_option_type)
    default: Any = None
    choices: tuple[Any, ...] | None = attrs.field(default=None,
                                                  converter=lambda v: None if v is None else tuple(v))
    help: str = ""
    # For a per-request field (``ModelSpec.request_fields``): the modes in which a request must give it, unless
    # it gives every request parameter named in ``unless`` (e.g. an explicit height and width); ``example`` is a
    # value that works, for the server's printed example request and the CLI's messages.
    required_for: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    unless: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    example: Any = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "type": self.type, "default": self.default,
               "choices": None if self.choices is None else list(self.choices), "help": self.help}
        if self.required_for:
            out.update(required_for=list(self.required_for), unless=list(self.unless), example=self.example)
        return out


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
    options: tuple[ModelOption, ...] = ()
    # Model-specific per-request fields (``GenerationRequest.extra``, HTTP ``model_params``) that clients may offer,
    # described with the same typed record as options; the model's own validation stays the authority.
    request_fields: tuple[ModelOption, ...] = ()
    # Every key ``GenerationRequest.extra`` may hold for this model; the core refuses any other key, naming it
    # (omnicore.engine.inputs.check_extra). ``None``: undeclared, the model's own preprocess is the only check.
    extra_fields: tuple[str, ...] | None = attrs.field(default=None,
                                                      converter=lambda v: None if v is None else _str_tuple(v))
    provider: str = ""
    # The linears per-request LoRA adapters may target (``None``: the model refuses ``loras``).
    lora: LoRATargets | None = None

    def load_impl(self) -> Any:  # the pipeline class (a Pipeline; it may carry more attributes)
        return resolve(self.impl)


# ---------------------------------------------------------------------------------------------- platforms


@attrs.frozen
class PlatformSpec:
    """A device platform. ``probe`` is a cheap "mod:fn" returning ``None`` when usable, else the reason it is not.

    ``omnicore plugins`` runs every probe to list availability, so a probe should avoid heavy imports where it
    can (e.g. check that the driver library exists before importing torch). ``attention_preference`` ranks the
    backends that meet a call site's requirement on this platform (listed ones first, in order; then priority).
    """

    name: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_path)  # platform class, "module:Class"
    device_type: str = "cpu"
    priority: int = 0  # higher wins automatic selection; CPU is the floor
    probe: str | None = attrs.field(default=None, validator=_check_path)
    attention_preference: tuple[str, ...] = ()  # backends ranked first by select_attention, in this order
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
    """Declared properties of an attention kernel. Undeclared means unsupported."""

    platforms: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    head_dims: tuple[int, int] = (1, 1024)  # inclusive range
    packed_varlen: bool = False  # honours cu_seqlens documents (AttentionMetadata)
    packed_mask_free: bool = False  # [real | pad] packing needs no mask
    sparse: bool = False  # executes AttentionMetadata.sparse_plan (dense backends ignore the plan)
    prefix_kv_slicing: bool = False  # honours AttentionMetadata.valid_kv_length (keys past it are padding)
    spans: bool = False  # honours causal attention with bidirectional AttentionMetadata.spans


def dtype_name(dtype: object) -> str:
    """The name attention capabilities and requirements use for a dtype: ``torch.bfloat16`` -> ``"bfloat16"``
    (a name passes through). Works on the object's ``str``, so this module never imports torch."""
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class AttentionRequirement:
    """What a model needs from attention at one call site; backends are matched against it."""

    platform: str = "cpu"
    dtype: str = "float32"
    head_dim: int = 64
    packed_varlen: bool = False
    packed_mask_free: bool = False
    sparse: bool = False
    prefix_kv_slicing: bool = False
    spans: bool = False

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
        for flag in ("packed_varlen", "packed_mask_free", "sparse", "prefix_kv_slicing", "spans"):
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

    def load_impl(self) -> Callable[..., torch.Tensor]:
        return resolve(self.impl)


# ---------------------------------------------------------------------------------------------- caches


@attrs.frozen
class CacheMethodSpec:
    """A cache/acceleration method. ``impl`` is ``apply(pipeline, config) -> handle``.

    ``resident`` (optional) is ``fn(pipeline) -> modules``: the modules whose parameters the method owns while it
    is enabled. Weight offload leaves them where they are (the method may move those weights itself), so offload
    asks the method instead of knowing any method by name.
    """

    name: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_path)
    conflicts: tuple[str, ...] = ()  # names that cannot be enabled together with this one
    requires: tuple[str, ...] = ()  # model capabilities it needs
    description: str = ""
    provider: str = ""
    resident: str | None = attrs.field(default=None, validator=_check_path)

    def load_impl(self) -> Callable[[Pipeline, object], CacheHandle]:  # (pipeline, the method config)
        return resolve(self.impl)

    def resident_modules(self, pipeline: object) -> list[nn.Module]:
        """The modules of ``pipeline`` whose parameters this method owns (none when it declares no ``resident``)."""
        return [] if self.resident is None else list(resolve(self.resident)(pipeline))


# ---------------------------------------------------------------------------------------------- platform ops


def _check_op_name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in OP_NAMES:
        raise ValueError(f"OpSpec.name: unknown op {value!r}; the core defines {', '.join(OP_NAMES)} "
                         "(each has an eager reference in omnicore.ops.reference)")


@attrs.frozen
class OpSpec:
    """A faster implementation of a named platform op (``omnicore.ops``) for one platform.

    ``impl`` takes the op's reference signature. ``applies`` (same arguments) says whether ``impl`` handles
    these inputs; when it returns False the next implementation (by ``priority``, highest first) or the eager
    reference runs instead. Several plugins may provide the same op for a platform.
    """

    name: str = attrs.field(validator=_check_op_name)
    platform: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_path)
    applies: str | None = attrs.field(default=None, validator=_check_path)
    priority: int = 0
    description: str = ""
    provider: str = ""

    @property
    def registry_key(self) -> str:
        """Key in the op registry: one implementation per (op, platform, provider)."""
        return f"{self.name}@{self.platform}:{self.provider}"

    def load_impl(self) -> Callable[..., object]:
        return resolve(self.impl)


SPEC_KINDS: Mapping[str, type] = {
    "model": ModelSpec,
    "platform": PlatformSpec,
    "attention_backend": AttentionBackendSpec,
    "cache_method": CacheMethodSpec,
    "op": OpSpec,
}

RegisterFn = Callable[[object], None]
