"""The plugin host: loads entry points one by one, keeps registries, and calls hooks by keyword.

We do not use ``PluginManager.load_setuptools_entrypoints``: it aborts on the first broken plugin. Here each
entry point is imported on its own; a failure is recorded (``FAILED`` with its error) and the rest load.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import importlib_metadata
import pluggy

from .. import hookspecs
from ..config import Settings, resolve_settings
from ..errors import (
    OmnicoreError,
    PlatformUnavailable,
    PluginError,
    UnsupportedFeature,
)
from ..registry import Registry
from ..specs import (
    AttentionBackendSpec,
    AttentionRequirement,
    CacheMethodSpec,
    ModelSpec,
    PlatformSpec,
)
from ._trace import install_tracing, log_call
from .records import DISABLED, FAILED, INCOMPATIBLE, LOADED, PluginRecord

logger = logging.getLogger("omnicore.plugins")

ENTRY_POINT_GROUP = "omnicore"
BUILTIN_NAME = "omnicore"

_REGISTRATION_HOOKS: tuple[tuple[str, str, type], ...] = (
    ("omnicore_register_models", "model", ModelSpec),
    ("omnicore_register_platforms", "platform", PlatformSpec),
    ("omnicore_register_attention_backends", "attention_backend", AttentionBackendSpec),
    ("omnicore_register_cache_methods", "cache_method", CacheMethodSpec),
)


def _one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line (multi-line messages joined with "; "), for records and problem lines."""
    parts = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {'; '.join(parts)}" if parts else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PluginHost:
    """Owns the pluggy manager, the plugin records and the four registries.

    ``PluginHost(autoload=False)`` gives an isolated host (only the core's built-ins) for tests; register
    more with :meth:`add_plugin`.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        autoload: bool = True,
        builtins: bool = True,
    ) -> None:
        self.settings = settings if settings is not None else resolve_settings()
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.problems: list[str] = []  # one clear line each: unknown names in env lists, duplicates ...
        self.probe_failures: dict[str, str] = {}  # platform name -> traceback of its raising probe
        self.registries: dict[str, Registry[Any]] = {
            "model": Registry("model"),
            "platform": Registry("platform"),
            "attention_backend": Registry("attention_backend"),
            "cache_method": Registry("cache_method"),
        }
        if self.settings.trace_plugins:
            install_tracing(self.pm)
        if builtins:
            from .. import _builtin

            self.add_plugin(_builtin, BUILTIN_NAME, dist="omnicore", version=_core_version())
        if autoload:
            self.load_entry_points()

    # ------------------------------------------------------------------ registries (typed shortcuts)
    @property
    def models(self) -> Registry[ModelSpec]:
        return self.registries["model"]

    @property
    def platforms(self) -> Registry[PlatformSpec]:
        return self.registries["platform"]

    @property
    def attention_backends(self) -> Registry[AttentionBackendSpec]:
        return self.registries["attention_backend"]

    @property
    def cache_methods(self) -> Registry[CacheMethodSpec]:
        return self.registries["cache_method"]

    # ------------------------------------------------------------------ loading
    def load_entry_points(self, entry_points: Iterable[Any] | None = None) -> None:
        """Discover, filter and import entry points of group ``omnicore``, each failure captured on its own."""
        eps = list(entry_points) if entry_points is not None else list(
            importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
        )
        allow = self.settings.plugins
        deny = self.settings.disable_plugins
        names = {ep.name for ep in eps}
        for listed, var in ((allow or (), "OMNICORE_PLUGINS"), (deny, "OMNICORE_DISABLE_PLUGINS")):
            for unknown in sorted(set(listed) - names - {"*"}):
                self._problem(
                    f"{var} names unknown plugin {unknown!r} (installed: {', '.join(sorted(names)) or 'none'})"
                )
        seen: dict[str, str] = {}
        for ep in eps:
            dist = ep.dist.name if getattr(ep, "dist", None) is not None else None
            version = ep.dist.version if getattr(ep, "dist", None) is not None else None
            if ep.name in seen or ep.name == BUILTIN_NAME:
                other = seen.get(ep.name, "omnicore (built-in)")
                msg = f"entry point name {ep.name!r} is used by both {other} and {dist}; skipping the one from {dist}"
                self._problem(msg)
                self._record_failure(f"{ep.name}@{dist}", dist, version, ep.value, msg, None, 0.0)
                continue
            seen[ep.name] = str(dist)
            if "*" in deny or ep.name in deny or (allow is not None and ep.name not in allow):
                self.records[ep.name] = PluginRecord(
                    name=ep.name, dist=dist, version=version, value=ep.value, status=DISABLED
                )
                continue
            start = time.perf_counter()
            try:
                obj = ep.load()
            except (Exception, SystemExit) as exc:  # KeyboardInterrupt propagates
                self._record_failure(
                    ep.name, dist, version, ep.value,
                    f"import of {ep.value!r} failed: {_one_line(exc)}",
                    traceback.format_exc(), time.perf_counter() - start,
                )
                continue
            self.add_plugin(obj, ep.name, dist=dist, version=version, value=ep.value,
                            import_s=time.perf_counter() - start)

    def add_plugin(
        self,
        plugin: object,
        name: str,
        *,
        dist: str | None = None,
        version: str | None = None,
        value: str | None = None,
        import_s: float = 0.0,
    ) -> PluginRecord:
        """Register a plugin object (module or instance) and run its registration hooks."""
        record = PluginRecord(name=name, dist=dist, version=version, value=value, import_s=import_s)
        self.records[name] = record
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validates impl signatures against the specs here
            self._fail(record, f"hook validation failed: {_one_line(exc)}", traceback.format_exc())
            return record
        unknown = [
            hc.name for hc in (self.pm.get_hookcallers(plugin) or []) if not hc.has_spec()
            and not all(impl.optionalhook for impl in hc.get_hookimpls() if impl.plugin is plugin)
        ]
        if unknown:
            self.pm.unregister(plugin)
            record.status = INCOMPATIBLE
            record.error = f"implements hooks this core does not know: {', '.join(sorted(unknown))}"
            self._problem(f"plugin {name!r}: {record.error}")
            return record
        record.hooks = sorted(hc.name for hc in (self.pm.get_hookcallers(plugin) or []))
        info = getattr(plugin, "plugin_info", None)
        if callable(info):
            try:
                record.info = dict(info())
            except Exception as exc:
                self._fail(record, f"plugin_info() raised {_one_line(exc)}", traceback.format_exc())
                return record
        self._run_registration(plugin, record)
        return record

    def _run_registration(self, plugin: object, record: PluginRecord) -> None:
        for hook_name, kind, spec_type in _REGISTRATION_HOOKS:
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                start = time.perf_counter()
                try:
                    impl.function(register=self._register_callback(record, kind, spec_type))
                except Exception as exc:
                    if self.settings.trace_plugins:
                        log_call(hook_name, record.name, time.perf_counter() - start, exc)
                    if isinstance(exc, PluginError) and exc.plugin == record.name:  # don't name the plugin twice
                        error = f"{type(exc).__name__}: {exc.cause}"
                    elif isinstance(exc, OmnicoreError):
                        error = _one_line(exc)
                    else:
                        error = f"{hook_name} raised {_one_line(exc)}"
                    self._fail(record, error, traceback.format_exc())
                    return
                if self.settings.trace_plugins:
                    log_call(hook_name, record.name, time.perf_counter() - start, None)

    def _register_callback(self, record: PluginRecord, kind: str, spec_type: type) -> Callable[..., Any]:
        registry = self.registries[kind]

        def register(spec: Any, *, replace: bool = False) -> None:
            if not isinstance(spec, spec_type):
                raise PluginError(record.name, f"register() for {kind} expects {spec_type.__name__}, "
                                  f"got {type(spec).__name__}")
            registry.register(spec, record.name, replace=replace)
            record.registered.setdefault(kind, []).append(spec.name)

        return register

    def _fail(self, record: PluginRecord, error: str, tb: str | None) -> None:
        for registry in self.registries.values():
            registry.unregister_provider(record.name)
        record.registered.clear()
        plugin = self.pm.get_plugin(record.name)
        if plugin is not None:
            self.pm.unregister(plugin)
        record.status = FAILED
        record.error = error
        record.traceback = tb
        self._problem(f"plugin {record.name!r} FAILED: {error}")

    def _record_failure(self, name: str, dist: str | None, version: str | None, value: str | None,
                        error: str, tb: str | None, import_s: float) -> None:
        self.records[name] = PluginRecord(name=name, dist=dist, version=version, value=value,
                                          status=FAILED, error=error, traceback=tb, import_s=import_s)
        if not error.startswith("entry point name"):
            self._problem(f"plugin {name!r} FAILED: {error}")

    def _problem(self, line: str) -> None:
        self.problems.append(line)
        logger.warning("%s", line)

    def require_loaded(self, name: str) -> None:
        """Raise the captured error when plugin ``name`` (e.g. the one providing the served model) failed."""
        rec = self.records.get(name)
        if rec is not None and rec.status != LOADED:
            raise PluginError(name, rec.error or rec.status)

    # ------------------------------------------------------------------ selection
    def select_platform(self, name: str | None = None) -> PlatformSpec:
        """The explicit platform (failing loudly if unavailable) or the best available one."""
        name = name or self.settings.platform
        if name:
            spec = self.platforms.get(name)
            rec = self.records.get(spec.provider)
            if rec is not None and rec.status != LOADED:
                raise PluginError(spec.provider, rec.error or rec.status)
            try:
                reason = spec.unavailable_reason()
            except Exception as exc:  # the explicit choice failing is a loud startup error, never a fallback
                raise PluginError(spec.provider, f"probe of platform {spec.name!r} raised {_one_line(exc)}") from exc
            if reason is not None:
                raise PlatformUnavailable(spec.name, reason)
            return spec
        for spec in sorted(self.platforms, key=lambda s: -s.priority):
            try:
                reason = spec.unavailable_reason()
            except Exception as exc:
                if spec.name in self.probe_failures:  # reported once, however often selection runs
                    continue
                self.probe_failures[spec.name] = traceback.format_exc()
                self._problem(f"platform {spec.name!r} (plugin {spec.provider!r}) probe FAILED: {_one_line(exc)}")
                continue
            if reason is None:
                return spec
            logger.info("platform %s not selected: %s", spec.name, reason)
        raise PlatformUnavailable("any", "no registered platform is available")

    def select_attention(self, requirement: AttentionRequirement) -> AttentionBackendSpec:
        """Pick the attention backend for a call site; every unmet constraint is reported together."""
        forced = self.settings.attention_backend
        if forced:
            spec = self.attention_backends.get(forced)
            unmet = requirement.unmet_by(spec.capabilities)
            if unmet:
                raise UnsupportedFeature(f"attention backend {spec.name!r}", "; ".join(unmet))
            return spec
        candidates = sorted(
            (s for s in self.attention_backends if not requirement.unmet_by(s.capabilities)),
            key=lambda s: -s.priority,
        )
        chosen = self.pm.hook.omnicore_attention_backend(requirement=requirement, candidates=candidates)
        if chosen is None:
            detail = "; ".join(
                f"{s.name}: {', '.join(requirement.unmet_by(s.capabilities))}" for s in self.attention_backends
            )
            raise UnsupportedFeature("attention", f"no backend meets {requirement} ({detail or 'none registered'})")
        return chosen

    def check_cache_methods(self, names: Sequence[str], model: ModelSpec | None = None) -> list[CacheMethodSpec]:
        """Resolve cache method names, rejecting unknown, unsupported and mutually exclusive combinations."""
        specs = [self.cache_methods.get(n) for n in names]
        problems = []
        for i, a in enumerate(specs):
            for b in specs[i + 1:]:
                if b.name in a.conflicts or a.name in b.conflicts:
                    problems.append(f"{a.name!r} and {b.name!r} are mutually exclusive")
            if model is not None and a.name not in model.capabilities.cache_methods:
                problems.append(f"model {model.name!r} does not support cache method {a.name!r} "
                                f"(supported: {', '.join(model.capabilities.cache_methods) or 'none'})")
        if problems:
            raise UnsupportedFeature("cache_methods", "; ".join(problems))
        return specs

    # ------------------------------------------------------------------ hook facade (always by keyword)
    def preprocess(self, request: Any, pipeline: Any) -> Any:
        return self.pm.hook.omnicore_preprocess(request=request, pipeline=pipeline)

    def denoise(self, pipeline: Any, state: Any, step: int) -> Any:
        return self.pm.hook.omnicore_denoise(pipeline=pipeline, state=state, step=step)

    def enable_cache(self, pipeline: Any, method: CacheMethodSpec, config: Any) -> Any:
        return self.pm.hook.omnicore_cache(pipeline=pipeline, method=method, config=config)

    def postprocess(self, request: Any, output: Any) -> Any:
        return self.pm.hook.omnicore_postprocess(request=request, output=output)


def _core_version() -> str:
    from .._version import __version__

    return __version__


_default: dict[str, PluginHost] = {}


def default_host() -> PluginHost:
    """The process-wide host, created on first use from the environment's settings."""
    host = _default.get("host")
    if host is None:
        host = _default["host"] = PluginHost()
    return host


def reset_default_host() -> None:
    """Forget the process-wide host (tests and long-lived shells after installing plugins)."""
    _default.clear()


__all__ = [
    "BUILTIN_NAME", "ENTRY_POINT_GROUP", "PluginHost", "PluginRecord", "default_host", "reset_default_host",
    "DISABLED", "FAILED", "INCOMPATIBLE", "LOADED"
]
