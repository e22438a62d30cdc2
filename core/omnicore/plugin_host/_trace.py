"""``OMNICORE_TRACE_PLUGINS=1``: log every hook call with the plugins it ran and its duration.

Lines go to ``sys.stderr`` as it is *at emit time* (so redirected or captured stderr sees them) with the
prefix ``omnicore.trace:``. Registration hooks are called one implementation at a time by the host, outside
pluggy's monitoring, so the host reports them through :func:`log_call` as well.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence

import pluggy

logger = logging.getLogger("omnicore.trace")


class _CurrentStderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is now (a plain StreamHandler would pin the stream at creation)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


def _ensure_handler() -> None:
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("omnicore.trace: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_call(hook_name: str, plugins: str, elapsed_s: float, exception: BaseException | None) -> None:
    """One trace line: hook, the plugins whose implementations ran, duration and outcome."""
    status = "raised " + type(exception).__name__ if exception is not None else "ok"
    logger.info("%s plugins=[%s] %.3f ms %s", hook_name, plugins or "-", elapsed_s * 1000.0, status)


def install_tracing(pm: pluggy.PluginManager) -> None:
    """Trace every hook call made through ``pm.hook`` (pluggy's call monitoring)."""
    _ensure_handler()
    starts: list[float] = []

    def before(hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, object]) -> None:
        starts.append(time.perf_counter())

    def after(outcome: pluggy.Result[object], hook_name: str, hook_impls: Sequence[pluggy.HookImpl],
              kwargs: Mapping[str, object]) -> None:
        elapsed = time.perf_counter() - starts.pop() if starts else float("nan")
        log_call(hook_name, ",".join(impl.plugin_name for impl in hook_impls), elapsed, outcome.exception)

    pm.add_hookcall_monitoring(before, after)
