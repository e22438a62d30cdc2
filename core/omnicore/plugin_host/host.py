"""The plugin host: loads entry points one by one, keeps registries, and calls hooks by keyword.

We do not use ``PluginManager.load_setuptools_entrypoints``: it aborts on the first broken plugin. Here each
entry point is imported on its own; a failure is recorded (``FAILED`` with its error) and the rest load.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import importlib_metadata
import pluggy

from .. import hookspecs
from ..config import Settings, resolve_settings
from ..errors import (
    OmnicoreError,
    PlatformUnavailable,
    PluginError,
    UnknownName,
    UnsupportedFeature,
)
from ..registry import Registry, key_of
from ..specs import (
    SPEC_KINDS,
    AttentionBackendSpec,
    AttentionRequirement,
    CacheMethodSpec,
    ModelSpec,
    OpSpec,
    PlatformSpec,
)
from ._compat import (
    EP_VALUE,
    api_mismatch,
    core_requirement_conflict,
    core_version,
    dist_name_version,
    normalise,
)
from ._trace import install_tracing, log_call
from .records import DISABLED, FAILED, INCOMPATIBLE, LOADED, PluginRecord

if TYPE_CHECKING:
    from ..engine.protocol import DenoiseState, Pipeline
    from ..engine.request import GenerationRequest
    from ..hookspecs import CacheHandle
    from ..ops.table import PlatformOps
    from ..outputs.output import Output
    from ..platforms.base import Platform

logger = logging.getLogger("omnicore.plugin_host")


class PlatformRow(TypedDict):
    """One row of :meth:`PluginHost.platform_availability`."""

    name: str
    provider: str
    device_type: str
    priority: int
    available: bool
    reason: str | None
    attention_preference: list[str]
    ops: dict[str, list[str]]

ENTRY_POINT_GROUP = "omnicore"
BUILTIN_NAME = "omnicore"

#: registration hook -> (registry kind, record type); e.g. omnicore_register_models -> ("model", ModelSpec)
_REGISTRATION_KINDS: dict[str, tuple[str, type]] = {
    f"omnicore_register_{kind}s": (kind, spec_type) for kind, spec_type in SPEC_KINDS.items()
}


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
        self.registries: dict[str, Registry[Any]] = {kind: Registry(kind) for kind in SPEC_KINDS}
        if self.settings.trace_plugins:
            install_tracing(self.pm)
        if builtins:
            from .. import _builtin

            self.add_plugin(_builtin, BUILTIN_NAME, dist="omnicore", version=core_version())
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

    @property
    def ops(self) -> Registry[OpSpec]:
        """Fast op implementations, keyed ``"<op>@<platform>:<provider>"`` (see :meth:`platform_ops`)."""
        return self.registries["op"]

    # ------------------------------------------------------------------ loading
    def load_entry_points(self, entry_points: Iterable[importlib_metadata.EntryPoint] | None = None) -> None:
        """Discover, filter and import entry points of group ``omnicore``, each failure captured on its own.

        Per entry point: a duplicate name is rejected naming both distributions; the
        allow/deny lists are applied (blocked plugins are never imported); the distribution's ``Requires-Dist``
        on ``omnicore`` must admit this core (else ``incompatible``, not imported); then it is imported, with
        ``Exception`` and ``SystemExit`` captured as ``failed``, and registered.
        """
        eps = list(entry_points) if entry_points is not None else list(
            importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
        )
        if not eps:
            logger.debug("no plugins installed in entry-point group %r", ENTRY_POINT_GROUP)
            return
        self._report_unknown_list_names(eps)
        seen: dict[str, str] = {BUILTIN_NAME: "omnicore (built-in)"}
        for ep in eps:
            dist, version = dist_name_version(ep)
            if ep.name in seen:
                self._problem(f"entry point name {ep.name!r} is used by both {seen[ep.name]} and {dist}; "
                              f"skipping the one from {dist}")
                self.records[f"{ep.name}@{dist}"] = PluginRecord(
                    name=f"{ep.name}@{dist}", dist=dist, version=version, value=ep.value, status=FAILED,
                    error=f"entry point name {ep.name!r} is already used by {seen[ep.name]}")
                continue
            seen[ep.name] = str(dist)
            record = PluginRecord(name=ep.name, dist=dist, version=version, value=ep.value)
            self.records[ep.name] = record
            if not self._allowed(ep.name, dist):
                record.status = DISABLED
                continue
            conflict = core_requirement_conflict(getattr(ep, "dist", None))
            if conflict is not None:
                self._reject(record, INCOMPATIBLE, conflict, None)
                continue
            if not EP_VALUE.match(ep.value or ""):
                self._reject(record, FAILED, f"entry point value {ep.value!r} is malformed (expected 'package.module' "
                             "or 'package.module:attr')", None)
                continue
            start = time.perf_counter()
            try:
                obj = ep.load()
            except (Exception, SystemExit) as exc:  # KeyboardInterrupt propagates
                record.import_s = time.perf_counter() - start
                self._reject(record, FAILED, f"import of {ep.value!r} failed: {_one_line(exc)}",
                             traceback.format_exc())
                continue
            self.add_plugin(obj, ep.name, dist=dist, version=version, value=ep.value,
                            import_s=time.perf_counter() - start)

    def _allowed(self, name: str, dist: str | None) -> bool:
        """Deny-list first (``*`` = every third-party plugin), then the allow-list; both accept entry-point
        or distribution names."""
        keys = {normalise(name)} | ({normalise(dist)} if dist else set())
        deny = {normalise(n) for n in self.settings.disable_plugins}
        if "*" in deny or keys & deny:
            return False
        allow = self.settings.plugins
        return allow is None or bool(keys & {normalise(n) for n in allow})

    def _report_unknown_list_names(self, eps: Sequence[importlib_metadata.EntryPoint]) -> None:
        installed = sorted({ep.name for ep in eps})
        known = {normalise(ep.name) for ep in eps} | {
            normalise(d) for d in (dist_name_version(ep)[0] for ep in eps) if d}
        for listed, var in ((self.settings.plugins or (), "OMNICORE_PLUGINS"),
                            (self.settings.disable_plugins, "OMNICORE_DISABLE_PLUGINS")):
            for unknown in sorted(n for n in set(listed) if n != "*" and normalise(n) not in known):
                self._problem(f"{var} names unknown plugin {unknown!r} (installed: {', '.join(installed)})")

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
            self._reject(record, FAILED, f"hook validation failed: {_one_line(exc)}", traceback.format_exc())
            return record
        callers = self.pm.get_hookcallers(plugin) or []
        unknown = [hc.name for hc in callers if not hc.has_spec()
                   and not all(impl.optionalhook for impl in hc.get_hookimpls() if impl.plugin is plugin)]
        if unknown:
            self._reject(record, INCOMPATIBLE,
                         f"implements hooks this core does not know: {', '.join(sorted(unknown))}", None)
            return record
        wrapped = [hc.name for hc in callers if hc.name in _REGISTRATION_KINDS and any(
            impl.wrapper or impl.hookwrapper for impl in hc.get_hookimpls() if impl.plugin is plugin)]
        if wrapped:
            self._reject(record, FAILED, f"registration hooks take no wrappers: {', '.join(sorted(wrapped))}", None)
            return record
        record.hooks = sorted(hc.name for hc in callers)
        info = getattr(plugin, "plugin_info", None)
        if callable(info):
            try:
                record.info = dict(info())
            except Exception as exc:
                self._reject(record, FAILED, f"plugin_info() raised {_one_line(exc)}", traceback.format_exc())
                return record
            mismatch = api_mismatch(record.info.get("api"))
            if mismatch is not None:
                self._reject(record, INCOMPATIBLE, mismatch, None)
                return record
        self._run_registration(plugin, record)
        return record

    def _run_registration(self, plugin: object, record: PluginRecord) -> None:
        for hook_name, (kind, spec_type) in _REGISTRATION_KINDS.items():
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
                    self._reject(record, FAILED, error, traceback.format_exc())
                    return
                if self.settings.trace_plugins:
                    log_call(hook_name, record.name, time.perf_counter() - start, None)

    def _register_callback(self, record: PluginRecord, kind: str, spec_type: type) -> Callable[..., None]:
        registry = self.registries[kind]

        def register(spec: object, *, replace: bool = False) -> None:
            if not isinstance(spec, spec_type):
                raise PluginError(record.name, f"register() for {kind} expects {spec_type.__name__}, "
                                  f"got {type(spec).__name__}")
            stored = registry.register(spec, record.name, replace=replace)
            record.registered.setdefault(kind, []).append(key_of(stored))

        return register

    def _reject(self, record: PluginRecord, status: str, error: str, tb: str | None) -> None:
        """Mark ``record`` failed/incompatible: undo whatever it registered and report one problem line."""
        for registry in self.registries.values():
            registry.unregister_provider(record.name)
        record.registered.clear()
        plugin = self.pm.get_plugin(record.name)
        if plugin is not None:
            self.pm.unregister(plugin)
        record.status = status
        record.error = error
        record.traceback = tb
        self._problem(f"plugin {record.name!r} {status.upper()}: {error}")

    def _problem(self, line: str) -> None:
        self.problems.append(line)
        logger.warning("%s", line)

    def not_loaded_summary(self) -> str:
        """One line naming every plugin that failed or is incompatible (appended to "unknown name" errors,
        since what a broken plugin would have registered is exactly what is missing)."""
        broken = [r for r in self.records.values() if r.status in (FAILED, INCOMPATIBLE)]
        return "; ".join(f"{r.name} ({r.dist or '?'} {r.version or '?'}) {r.status}: {r.error}" for r in broken)

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
            if name not in self.platforms:
                raise UnknownName("platform", name, self.platforms.providers(),
                                  hint=f"plugins that did not load: {self.not_loaded_summary()}"
                                  if self.not_loaded_summary() else "")
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

    def platform_availability(self) -> list[PlatformRow]:
        """Every registered platform with whether it can run here and why not (for ``omnicore plugins``).

        A raising probe is reported as unavailable with the error (never raised)."""
        rows: list[PlatformRow] = []
        for spec in sorted(self.platforms, key=lambda s: (-s.priority, s.name)):
            try:
                reason = spec.unavailable_reason()
            except Exception as exc:  # noqa: BLE001 - a broken probe is listed as the reason, never raised
                reason = f"probe raised {_one_line(exc)}"
            rows.append({"name": spec.name, "provider": spec.provider, "device_type": spec.device_type,
                         "priority": spec.priority, "available": reason is None, "reason": reason,
                         "attention_preference": list(spec.attention_preference),
                         "ops": self.platform_ops(spec.name).provided()})
        return rows

    def platform_ops(self, platform: str) -> PlatformOps:
        """The op table of ``platform``: every registered fast op for it, eager references for the rest."""
        from ..ops.table import PlatformOps

        return PlatformOps(platform, self.ops)

    def bind_platform_ops(self, platform: Platform, name: str | None = None) -> Platform:
        """Give a platform instance this host's op table (``platform.ops``), its fast kernels imported now (a
        broken one fails here, naming its plugin); returns the instance."""
        platform.ops = self.platform_ops(name or platform.name).prepare()
        return platform

    def check_model_platform(self, model: ModelSpec, platform: str) -> None:
        """Fail before any weight is read when the model needs packed-varlen attention (its capability
        ``needs_packed_varlen``) and no registered backend offers it on ``platform``."""
        if not model.capabilities.needs_packed_varlen:
            return
        if any(platform in s.capabilities.platforms and s.capabilities.packed_varlen for s in self.attention_backends):
            return
        raise UnsupportedFeature(f"model {model.name!r} on platform {platform!r}",
                                 "it needs a packed-varlen attention backend (cu_seqlens documents) and none "
                                 f"is registered for {platform!r} (registered: "
                                 f"{', '.join(self.attention_backends.names()) or 'none'})")

    def _preference(self, platform: str) -> tuple[str, ...]:
        return self.platforms.get(platform).attention_preference if platform in self.platforms else ()

    def select_attention(self, requirement: AttentionRequirement) -> AttentionBackendSpec:
        """Pick the attention backend for a call site; every unmet constraint is reported together.

        Candidates are the backends meeting the requirement, ordered by the requirement platform's
        ``attention_preference`` (listed backends first, in that order), then by priority; the
        ``omnicore_attention_backend`` hook chooses among them (the core's default takes the first)."""
        forced = self.settings.attention_backend
        if forced:
            spec = self.attention_backends.get(forced)
            unmet = requirement.unmet_by(spec.capabilities)
            if unmet:
                raise UnsupportedFeature(f"attention backend {spec.name!r}", "; ".join(unmet))
            return spec
        preference = self._preference(requirement.platform)
        rank = {name: i for i, name in enumerate(preference)}
        candidates = sorted(
            (s for s in self.attention_backends if not requirement.unmet_by(s.capabilities)),
            key=lambda s: (rank.get(s.name, len(rank)), -s.priority),
        )
        chosen = self.pm.hook.omnicore_attention_backend(requirement=requirement, candidates=candidates)
        if chosen is None:
            detail = "; ".join(
                f"{s.name}: {', '.join(requirement.unmet_by(s.capabilities))}" for s in self.attention_backends
            )
            raise UnsupportedFeature("attention", f"no backend meets {requirement} ({detail or 'none registered'})")
        unmet = requirement.unmet_by(chosen.capabilities)
        if unmet:  # a tryfirst/wrapper implementation picked a backend outside the candidates
            raise UnsupportedFeature(f"attention backend {chosen.name!r} (chosen by the omnicore_attention_backend "
                                     f"hook)", "; ".join(unmet))
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
    def preprocess(self, request: GenerationRequest, pipeline: Pipeline) -> GenerationRequest | None:
        return self.pm.hook.omnicore_preprocess(request=request, pipeline=pipeline)

    def denoise(self, pipeline: Pipeline, state: DenoiseState, step: int) -> DenoiseState | None:
        return self.pm.hook.omnicore_denoise(pipeline=pipeline, state=state, step=step)

    def enable_cache(self, pipeline: Pipeline, method: CacheMethodSpec, config: object) -> CacheHandle:
        """The handle of ``method`` on ``pipeline`` (the core's ``trylast`` implementation always answers)."""
        return self.pm.hook.omnicore_cache(pipeline=pipeline, method=method, config=config)

    def postprocess(self, request: GenerationRequest, output: Output) -> Output | None:
        return self.pm.hook.omnicore_postprocess(request=request, output=output)


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
