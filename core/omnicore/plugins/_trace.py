"""``OMNICORE_TRACE_PLUGINS=1``: log every hook call with the plugins it ran and its duration."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import pluggy

logger = logging.getLogger("omnicore.trace")


def install_tracing(pm: pluggy.PluginManager) -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("omnicore.trace: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    starts: list[float] = []

    def before(hook_name: str, hook_impls: list[Any], kwargs: dict[str, Any]) -> None:
        starts.append(time.perf_counter())

    def after(outcome: Any, hook_name: str, hook_impls: list[Any], kwargs: dict[str, Any]) -> None:
        elapsed_ms = (time.perf_counter() - starts.pop()) * 1000.0 if starts else float("nan")
        plugins = ",".join(impl.plugin_name for impl in hook_impls) or "-"
        status = "raised " + type(outcome.exception).__name__ if outcome.exception else "ok"
        logger.info("%s plugins=[%s] %.3f ms %s", hook_name, plugins, elapsed_ms, status)

    pm.add_hookcall_monitoring(before, after)
