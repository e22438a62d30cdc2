"""Progress reported from inside a stage: a model that writes text before it draws (``think``).

The runner reports denoise steps by itself. A stage that runs as one pipeline call (``encode``) can hold a long
loop of its own — HunyuanImage-3 decodes a chain of thought token by token before its first denoise step — so the
runner opens a :func:`stage_progress_scope` around it and the pipeline calls :func:`report_stage_progress` as the
loop advances. Each report becomes a progress event of the request's job (``phase="think"``, ``step`` = tokens
written, ``total_steps`` = the budget). Outside a runner's scope (a pipeline called directly) a report does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ..phases import THINK

#: the phases a pipeline may report from inside a stage
STAGE_PHASES: tuple[str, ...] = (THINK,)

Reporter = Callable[[str, int, int, "int | None"], None]

_REPORT: ContextVar[Reporter | None] = ContextVar("omnicore_stage_progress", default=None)


def report_stage_progress(phase: str, done: int, total: int, *, row: int | None = None) -> None:
    """Report ``done`` of ``total`` units of ``phase`` for the batch's request at index ``row`` (every request of
    the batch when ``None``). ``phase`` must be one of :data:`STAGE_PHASES`."""
    if phase not in STAGE_PHASES:
        raise ValueError(f"report_stage_progress: phase must be one of {STAGE_PHASES}, got {phase!r}")
    if done < 0 or total < 0:
        raise ValueError(f"report_stage_progress: done and total must be >= 0, got {done} and {total}")
    report = _REPORT.get()
    if report is not None:
        report(phase, done, total, row)


@contextmanager
def stage_progress_scope(report: Reporter) -> Iterator[None]:
    """Deliver :func:`report_stage_progress` calls made inside the block to ``report`` (the runner's side)."""
    token = _REPORT.set(report)
    try:
        yield
    finally:
        _REPORT.reset(token)
