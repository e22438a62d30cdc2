"""Model resolution and loading: ``tiny:<preset>``, a local checkpoint directory, or a Hugging Face repo id.

The load sequence of every process that serves a model — the :class:`~omnicore.engine.api.Engine`'s and each
parallel worker rank's (:mod:`omnicore.parallel.worker`) — is the three steps here, in this order:
:func:`resolve_load` (platform instance, model files and spec, the model's declared options), :func:`load_options`
and :func:`load_pipeline`. The engine runs its own refusals inside ``resolve_load`` (``check``) and starts its
worker group between the last two; a worker rank runs them back to back (:func:`load_model`).

Tiny presets are built once into ``<cache>/presets/<name>/`` (built in a temporary sibling directory and
renamed into place, so a crash never leaves a half-written checkpoint) with a marker holding a hash of the
builder's source: editing the builder rebuilds the preset on next use.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ..checkpoint import read_json_or_empty
from ..errors import InvalidRequest, PluginError, UnknownName
from ..specs import ModelSpec, PresetSpec, resolve
from .model_options import resolve_model_options
from .protocol import LoadOptions

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    import torch

    from ..config import Settings
    from ..parallel.context import ParallelContext
    from ..platforms.base import Platform
    from ..plugin_host.host import PluginHost
    from ..specs import AttentionRequirement
    from .protocol import AttentionSelector, Pipeline

logger = logging.getLogger("omnicore.engine")

TINY_PREFIX = "tiny:"
MARKER = ".omnicore-preset.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@attrs.frozen
class ResolvedModel:
    """Where a model's files are and which spec serves them."""

    spec: ModelSpec
    path: Path
    source: str  # "preset" | "local" | "hub"
    preset: str | None = None


def known_models(host: PluginHost) -> dict[str, str]:
    """Every name ``--model`` accepts that maps to a registered thing (``tiny:`` presets and model names)."""
    known: dict[str, str] = {}
    for spec in host.models:
        known[spec.name] = spec.provider
        for preset in spec.presets:
            known[_preset_ref(preset)] = spec.provider
    return known


def _preset_ref(preset: PresetSpec) -> str:
    return preset.name if preset.name.startswith(TINY_PREFIX) else TINY_PREFIX + preset.name


def find_preset(host: PluginHost, ref: str) -> tuple[ModelSpec, PresetSpec]:
    """The spec and preset named ``tiny:<name>`` (the preset may be registered as ``name`` or ``tiny:name``)."""
    for spec in host.models:
        for preset in spec.presets:
            if _preset_ref(preset) == ref.lower():
                return spec, preset
    raise UnknownName("model", ref, known_models(host))


def preset_spec(spec: ModelSpec, preset: PresetSpec) -> ModelSpec:
    """The spec as served from ``preset``: the preset's request defaults (when it declares any) replace the
    model's, so the pipeline's ``preprocess``, the engine's seed and ``/v1/models`` all see them."""
    return spec if preset.defaults is None else attrs.evolve(spec, defaults=preset.defaults)


def builder_fingerprint(preset: PresetSpec) -> str:
    """Hash of the preset's builder path plus every Python source of the package that defines it.

    Hashing the whole package (not only the builder's module) means a change to, say, the model's layer
    definitions or config schema also rebuilds the preset, so a cached checkpoint never goes stale.
    """
    digest = hashlib.sha256(preset.builder.encode())
    fn = resolve(preset.builder)
    try:
        source_file = inspect.getsourcefile(fn)
    except TypeError:
        source_file = None
    if not source_file:
        digest.update(repr(fn).encode())
        return digest.hexdigest()
    top = preset.builder.partition(":")[0].split(".")[0]
    module_path = Path(source_file).resolve()
    root = next((p for p in module_path.parents if p.name == top and (p / "__init__.py").is_file()), None)
    files = sorted(root.rglob("*.py")) if root is not None else [module_path]
    for path in files:
        digest.update(str(path.relative_to(root) if root is not None else path.name).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def ensure_preset(spec: ModelSpec, preset: PresetSpec, cache_root: Path) -> Path:
    """Build the preset into ``cache_root/presets/<name>`` unless an up-to-date build is there.

    Several processes may ask at once (replicas started together on one cache): one builds while the others wait on
    a lock file, then find its build. A build is written to a temporary folder and renamed into place, and an
    up-to-date build already in place is never replaced, since another process may be loading from it."""
    name = _preset_ref(preset)[len(TINY_PREFIX):]
    target = cache_root / "presets" / name
    fingerprint = builder_fingerprint(preset)
    if _up_to_date(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    locks = cache_root / ".locks"  # beside presets/, which holds only builds
    locks.mkdir(exist_ok=True)
    with _exclusive(locks / f"preset-{name}.lock"):
        if _up_to_date(target, fingerprint):  # built by another process while this one waited
            return target
        if (target / MARKER).is_file():
            logger.info("preset %s changed; rebuilding %s", name, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            resolve(preset.builder)(tmp)
            (tmp / MARKER).write_text(json.dumps({"preset": name, "model": spec.name, "builder": preset.builder,
                                                  "fingerprint": fingerprint}))
            if target.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".{name}-old-", dir=target.parent))
                os.replace(target, trash / name)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, target)
        except Exception as exc:
            raise PluginError(spec.provider or spec.name,
                              f"building preset {_preset_ref(preset)!r} failed: {exc}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _up_to_date(target: Path, fingerprint: str) -> bool:
    try:
        return json.loads((target / MARKER).read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive lock between processes (``fcntl.flock``; where there is no ``fcntl`` the block runs unlocked
    and the rename-into-place build is still whole, only possibly built twice)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def detect_spec(host: PluginHost, path: Path) -> ModelSpec:
    """The spec serving a checkpoint directory: a spec's ``detect`` first, then declared class names."""
    specs = list(host.models)
    for spec in specs:
        if spec.detect is None:
            continue
        try:
            if resolve(spec.detect)(path):
                return spec
        except Exception as exc:
            logger.warning("detector of model %s (%s) raised: %s", spec.name, spec.provider, exc)
    names = []
    class_name = read_json_or_empty(path / "model_index.json").get("_class_name")
    if isinstance(class_name, str):
        names.append(class_name)
    archs = read_json_or_empty(path / "config.json").get("architectures")
    if isinstance(archs, list):
        names.extend(a for a in archs if isinstance(a, str))
    for candidate in names:
        for spec in specs:
            if candidate.lower() in (spec.name, *(a.lower() for a in spec.aliases)):
                return spec
    raise InvalidRequest(
        "model", f"no installed model plugin recognises the checkpoint at {path} (declared classes: "
        f"{names or 'none'}; known models: {', '.join(sorted(s.name for s in specs)) or 'none installed'})")


def explicit_model(host: PluginHost, text: str) -> tuple[ModelSpec, str] | None:
    """``<model name>:<checkpoint dir or repo id>`` (e.g. ``diffusers:./tiny-flux``): the named model serves it,
    with no layout detection (a generic plugin asked for by name, or a checkpoint two plugins could claim).
    ``None`` when ``text`` has no such prefix (``tiny:`` is the preset prefix, handled before this)."""
    prefix, sep, rest = text.partition(":")
    if not sep or not rest or prefix.lower() == TINY_PREFIX[:-1]:
        return None
    spec = next((s for s in host.models if s.name.lower() == prefix.lower()), None)
    return None if spec is None else (spec, rest)


def resolve_model(model: str | os.PathLike[str], host: PluginHost, settings: Settings) -> ResolvedModel:
    """Turn the user's ``model`` argument into a spec and a directory (building or downloading as needed)."""
    text = os.fspath(model)
    if text.lower().startswith(TINY_PREFIX):
        spec, preset = find_preset(host, text)
        path = ensure_preset(spec, preset, settings.cache_path)
        return ResolvedModel(preset_spec(spec, preset), path, "preset", preset.name)
    explicit = explicit_model(host, text)
    if explicit is not None:
        spec, rest = explicit
        where = Path(rest).expanduser()
        if where.is_dir():
            return ResolvedModel(spec, where, "local")
        if _REPO_ID.match(rest) and not where.exists():
            return ResolvedModel(spec, _download(rest, settings), "hub")
        raise InvalidRequest("model", f"{spec.name}:{rest}: {rest!r} is neither a checkpoint directory nor a "
                                      "Hugging Face repo id")
    path = Path(text).expanduser()
    if path.is_dir():
        return ResolvedModel(detect_spec(host, path), path, "local")
    if _REPO_ID.match(text) and not path.exists():
        local = _download(text, settings)
        return ResolvedModel(detect_spec(host, local), local, "hub")
    raise UnknownName("model", text, known_models(host))


def _download(repo_id: str, settings: Settings) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise InvalidRequest("model", f"huggingface-hub is needed to download {repo_id!r}: {exc}") from exc
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(settings.cache_path / "hub")))
    except Exception as exc:
        raise InvalidRequest(
            "model", f"could not download Hugging Face repo {repo_id!r} ({type(exc).__name__}: {exc}); "
            "check the network or pass tiny:<preset> or a local checkpoint directory") from exc


def instantiate_platform(host: PluginHost, platform: str | Platform | None) -> Platform:
    """The platform instance, bound to the host's op table (``platform.ops``, fast kernels of its plugins)."""
    if platform is not None and not isinstance(platform, str):
        return host.bind_platform_ops(platform)
    spec = host.select_platform(platform)
    try:
        instance = spec.load_impl()()
    except Exception as exc:
        raise PluginError(spec.provider or spec.name, f"creating platform {spec.name!r} failed: {exc}") from exc
    return host.bind_platform_ops(instance, spec.name)


@attrs.frozen
class LoadTarget:
    """What one process loads, resolved before any weight is read: the platform it runs on, the model's files
    and spec, and every option the model declares with its checked value (defaults filled)."""

    platform: Platform
    resolved: ResolvedModel
    model_options: Mapping[str, Any]


def resolve_load(host: PluginHost, model: str | os.PathLike[str], settings: Settings, *,
                 platform: str | Platform | None, model_options: Mapping[str, Any] | None,
                 check: Callable[[Platform, ResolvedModel], None] | None = None) -> LoadTarget:
    """Step 1 of the load sequence: the platform instance, the resolved model (a preset built, a repo downloaded
    as needed), then ``check(platform, resolved)`` (the caller's refusals that need the spec), then the model's
    declared options (unknown names and bad values are a ``ConfigError``)."""
    instance = instantiate_platform(host, platform)
    resolved = resolve_model(model, host, settings)
    if check is not None:
        check(instance, resolved)
    return LoadTarget(instance, resolved, resolve_model_options(resolved.spec, model_options))


def load_options(target: LoadTarget, *, attention: AttentionSelector, offload: str,
                 vae_decode_precision: str | None, parallel: ParallelContext | None = None) -> LoadOptions:
    """Step 2: the :class:`LoadOptions` the pipeline's ``from_pretrained`` gets (the platform's default dtype; a
    bad ``vae_decode_precision`` is a ``ConfigError`` here, before anything loads)."""
    return LoadOptions(platform=target.platform, dtype=target.platform.default_dtype(), attention=attention,
                       offload=offload, model_options=dict(target.model_options),
                       vae_decode_precision=vae_decode_precision, parallel=parallel)


def load_pipeline(resolved: ResolvedModel, options: LoadOptions, host: PluginHost | None = None) -> Pipeline:
    """Step 3: import the spec's pipeline class and call ``from_pretrained``; the loaded pipeline carries the spec,
    and ``host`` when it set none itself (step caches join that host's ``omnicore_denoise`` hook)."""
    try:
        cls = resolved.spec.load_impl()
    except Exception as exc:
        raise PluginError(resolved.spec.provider or resolved.spec.name,
                          f"importing pipeline {resolved.spec.impl!r} failed: {exc}") from exc
    pipeline = cls.from_pretrained(resolved.path, options)
    pipeline.spec = resolved.spec
    if host is not None and getattr(pipeline, "host", None) is None:
        pipeline.host = host
    return pipeline


def load_model(host: PluginHost, model: str | os.PathLike[str], settings: Settings, *,
               platform: str | Platform | None, model_options: Mapping[str, Any] | None, offload: str,
               vae_decode_precision: str | None, parallel: ParallelContext | None = None,
               attention: AttentionSelector | None = None) -> tuple[LoadTarget, Pipeline]:
    """The three steps back to back (a parallel worker rank: nothing starts between them); ``attention``
    defaults to the host's selection."""
    target = resolve_load(host, model, settings, platform=platform, model_options=model_options)
    if attention is None:
        def attention(requirement: AttentionRequirement) -> Callable[..., torch.Tensor]:
            return host.select_attention(requirement).load_impl()
    options = load_options(target, attention=attention, offload=offload,
                           vae_decode_precision=vae_decode_precision, parallel=parallel)
    return target, load_pipeline(target.resolved, options, host)
