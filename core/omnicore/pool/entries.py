"""What one model of a pool is: :class:`ModelEntry`, from code, from ``omnicore serve A B C`` or from a
``models.toml`` file (:func:`load_models_file`).

A ``models.toml`` has an optional ``[pool]`` table and one ``[[model]]`` table per model::

    [pool]
    memory_budget = "24GiB"          # per device; default: the device's memory
    host_memory_budget = "64GiB"     # offloaded models beyond this are unloaded (LRU); default: no limit

    [[model]]
    name = "video"                   # the name requests use in `model` (default: the model's own name)
    checkpoint = "tiny:lingbot"      # tiny:<preset>, a checkpoint directory or a Hugging Face repo id
    aliases = ["lingbot-video"]
    options = { height = 480 }       # the model's declared options (`omnicore models` lists them)
    caches = ["teacache"]
    offload = "none"                 # the engine's own offload while it is loaded: none | model | layerwise
    parallel = "cfg=2"               # a parallel model is never swapped (its worker ranks hold its weights)
    quantization = "int8"
    device_memory = 20               # GiB per rank: requests this model's placement cannot hold are refused (400)
    priority = 10                    # higher stays resident longer when room is needed
    pinned = true                    # never swapped out
    max_queue = 32                   # this model's queue limit (default: --max-queue)
    max_num_seqs = 2                 # this model's batch limit (default: --max-num-seqs)
    [model.defaults]                 # request defaults for this deployment (preset defaults)
    num_inference_steps = 8
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..errors import ConfigError
from ..sizes import parse_bytes

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_MODEL_KEYS = ("name", "checkpoint", "aliases", "options", "caches", "offload", "parallel", "quantization",
               "priority", "pinned", "max_queue", "max_num_seqs", "defaults", "vae_decode_precision", "compile",
               "device_memory")
_POOL_KEYS = ("memory_budget", "host_memory_budget")
_DEFAULT_FIELDS = ("height", "width", "num_frames", "fps", "num_inference_steps", "guidance_scale", "flow_shift",
                   "seed", "negative_prompt")


def _tuple(value: Any) -> tuple[str, ...]:
    return tuple(value) if value is not None else ()


@attrs.frozen(kw_only=True)
class ModelEntry:
    """One model the pool serves. ``name`` is what requests put in ``model``; ``checkpoint`` what to load
    (``tiny:<preset>``, a directory, a Hugging Face repo id). The engine keywords (``options``, ``caches``,
    ``offload``, ``parallel``, ``quantization``, ``compile``, ``vae_decode_precision``, ``device_memory``) are
    :class:`~omnicore.engine.api.Engine`'s own (``device_memory``: the per-rank limit its admission checks each
    request against, GiB; ``None``: the engine's default). ``priority`` (higher = kept longer) and ``pinned``
    (never swapped out) steer eviction; ``max_queue``/``max_num_seqs`` override the server-wide limits for this model;
    ``defaults`` override the model's request defaults (e.g. fewer steps for a draft deployment)."""

    name: str
    checkpoint: str
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    options: Mapping[str, Any] = attrs.field(factory=dict)
    caches: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    offload: str = "none"
    parallel: Any = None  # "cfg=2", a ParallelConfig, or None
    quantization: str | None = None
    device_memory: float | None = None
    compile: bool | str = False
    vae_decode_precision: str | None = None
    priority: int = 0
    pinned: bool = False
    max_queue: int | None = None
    max_num_seqs: int | None = None
    defaults: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        for field, value in (("name", self.name), *((f"aliases[{i}]", a) for i, a in enumerate(self.aliases))):
            if not isinstance(value, str) or not _NAME.match(value):
                raise ConfigError(f"model.{field}", f"must be 1-128 characters of letters, digits and ._:/- "
                                                    f"starting with a letter or digit, got {value!r}")
        if not isinstance(self.checkpoint, str) or not self.checkpoint.strip():
            raise ConfigError(f"model {self.name!r}: checkpoint", "must be tiny:<preset>, a checkpoint directory "
                                                                  "or a Hugging Face repo id")
        for field in ("max_queue", "max_num_seqs"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"model {self.name!r}: {field}", f"must be a positive integer, got {value!r}")
        if self.device_memory is not None and (isinstance(self.device_memory, bool) or not isinstance(
                self.device_memory, (int, float)) or self.device_memory < 0):
            raise ConfigError(f"model {self.name!r}: device_memory", f"must be a number of GiB >= 0 (0: no check), "
                                                                     f"got {self.device_memory!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError(f"model {self.name!r}: priority", f"must be an integer, got {self.priority!r}")
        try:
            self.parallel_enabled  # noqa: B018  (a malformed layout fails here, before anything loads)
        except ConfigError as exc:
            raise ConfigError(f"model {self.name!r}: parallel", exc.rule) from None
        unknown = sorted(set(self.defaults) - set(_DEFAULT_FIELDS))
        if unknown:
            raise ConfigError(f"model {self.name!r}: defaults.{unknown[0]}",
                              f"is not a request default (known: {', '.join(_DEFAULT_FIELDS)})")

    @property
    def parallel_enabled(self) -> bool:
        """Whether this model runs over several ranks (then the pool never swaps it)."""
        from ..parallel.config import ParallelConfig

        return ParallelConfig.parse(self.parallel).enabled

    @property
    def names(self) -> tuple[str, ...]:
        """``name``, then the aliases (the checkpoint argument is added by the pool where it is unambiguous)."""
        return tuple(dict.fromkeys((self.name, *self.aliases)))

    def engine_kwargs(self) -> dict[str, Any]:
        """The :class:`~omnicore.engine.api.Engine` keywords of this entry."""
        kwargs: dict[str, Any] = {"cache_methods": self.caches, "offload": self.offload,
                                  "model_options": dict(self.options), "parallel": self.parallel,
                                  "vae_decode_precision": self.vae_decode_precision, "compile": self.compile}
        if self.quantization not in (None, "none"):
            kwargs["quantization"] = self.quantization
        if self.device_memory is not None:
            kwargs["device_memory"] = float(self.device_memory)
        return kwargs


@attrs.frozen
class PoolFile:
    """A parsed ``models.toml``: the entries and the ``[pool]`` budgets (bytes, ``None`` = unset)."""

    entries: tuple[ModelEntry, ...]
    memory_budget: int | None = None
    host_memory_budget: int | None = None


def default_name(checkpoint: str) -> str:
    """The served name of ``omnicore serve tiny:lingbot`` (``lingbot``) or of a directory (its last part)."""
    text = checkpoint.strip()
    if text.lower().startswith("tiny:"):
        return text[5:]
    tail = Path(text.rstrip("/")).name or text
    return re.sub(r"[^A-Za-z0-9._:/-]+", "-", tail).strip("-.") or "model"


def entries_from_args(models: Sequence[str]) -> list[ModelEntry]:
    """``omnicore serve A B C``: one entry per argument, named after it (``tiny:lingbot`` -> ``lingbot``, a directory
    by its last part); an argument may name itself as ``name=checkpoint``."""
    entries = []
    for arg in models:
        name, sep, checkpoint = arg.partition("=")
        if not sep:
            name, checkpoint = default_name(arg), arg
        entries.append(ModelEntry(name=name, checkpoint=checkpoint))  # (the pool adds the argument as a name)
    check_unique(entries)
    return entries


def check_unique(entries: Sequence[ModelEntry]) -> None:
    """Every name and alias names one model: a clash is a ``ConfigError`` naming both."""
    if not entries:
        raise ConfigError("models", "a pool needs at least one model")
    owner: dict[str, str] = {}
    for entry in entries:
        for n in entry.names:
            if n in owner and owner[n] != entry.name:
                raise ConfigError("model.name", f"{n!r} names both {owner[n]!r} and {entry.name!r}; give one of "
                                                "them another name (name=... or name = in models.toml)")
            if n in owner and n == entry.name:
                raise ConfigError("model.name", f"two models are named {n!r}; give one of them another name")
            owner[n] = entry.name


def _entry_from_table(i: int, table: Any, base: Path) -> ModelEntry:
    where = f"model[{i}]"
    if not isinstance(table, dict):
        raise ConfigError(where, "must be a table ([[model]])")
    unknown = sorted(set(table) - set(_MODEL_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"is not a model setting (known: {', '.join(_MODEL_KEYS)})")
    if "checkpoint" not in table:
        raise ConfigError(f"{where}.checkpoint", "is required (tiny:<preset>, a directory or a repo id)")
    checkpoint = str(table["checkpoint"])
    local = Path(checkpoint).expanduser()
    if not checkpoint.lower().startswith("tiny:") and not local.is_absolute() and (base / local).is_dir():
        checkpoint = str(base / local)  # relative to the file, like most config files
    kinds = {"aliases": list, "options": dict, "caches": list, "defaults": dict, "pinned": bool}
    for key, kind in kinds.items():
        if key in table and not isinstance(table[key], kind):
            raise ConfigError(f"{where}.{key}", f"must be a {'table' if kind is dict else kind.__name__}, "
                                                f"got {table[key]!r}")
    values = {k: v for k, v in table.items() if k != "checkpoint"}
    values.setdefault("name", default_name(checkpoint))
    if "parallel" in values and values["parallel"] is not None:
        values["parallel"] = str(values["parallel"])
    return ModelEntry(checkpoint=checkpoint, **values)


def load_models_file(path: str | Path) -> PoolFile:
    """Parse ``models.toml`` (see the module docstring); errors name the table and key."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the backport, when installed
        try:
            import tomli as tomllib  # type: ignore[no-redef, unused-ignore]
        except ModuleNotFoundError:
            raise ConfigError("--models", "reading models.toml needs Python 3.11+ (tomllib) or the tomli "
                                          "package on Python 3.10 (pip install tomli)") from None
    path = Path(path).expanduser()
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError("--models", f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--models", f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(doc) - {"pool", "model"})
    if unknown:
        raise ConfigError(unknown[0], "is not a table of models.toml (known: [pool], [[model]])")
    pool = doc.get("pool", {})
    if not isinstance(pool, dict):
        raise ConfigError("pool", "must be a table ([pool])")
    bad = sorted(set(pool) - set(_POOL_KEYS))
    if bad:
        raise ConfigError(f"pool.{bad[0]}", f"is not a pool setting (known: {', '.join(_POOL_KEYS)})")
    tables = doc.get("model", [])
    if not isinstance(tables, list) or not tables:
        raise ConfigError("model", f"{path} declares no [[model]] table")
    entries = [_entry_from_table(i, t, path.parent) for i, t in enumerate(tables)]
    check_unique(entries)
    return PoolFile(tuple(entries), parse_bytes("pool.memory_budget", pool.get("memory_budget")),
                    parse_bytes("pool.host_memory_budget", pool.get("host_memory_budget")))
