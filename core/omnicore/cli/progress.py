"""Progress output of ``omnicore generate``: a tqdm bar on a terminal, a few plain lines otherwise.

On a terminal (``stream.isatty()``) a tqdm bar is redrawn in place (percent, phase, denoise step, elapsed and
ETA). Anywhere else — logs, CI, a pipe — redrawing only floods the file, so one line is written when the phase
changes and whenever progress passes another ``every_percent`` (default 10 %), plus the final line.
``TQDM_DISABLE`` (which ``cli.quiet`` sets to silence third-party bars) does not hide this bar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from ..engine.progress import ProgressEvent


def _describe(event: ProgressEvent) -> str:
    if event.phase == "think":  # a model writing text first: its count is tokens of the budget
        return f"think {event.step}/{event.total_steps} tokens" if event.total_steps else "think"
    steps = f" step {event.step}/{event.total_steps}" if event.total_steps else ""
    return f"{event.phase}{steps}"


class ProgressPrinter:
    """A job listener (``job.add_listener``/``on_event``) drawing the job's :class:`ProgressEvent` stream."""

    def __init__(self, stream: TextIO, *, every_percent: int = 10, tty: bool | None = None) -> None:
        if not 1 <= every_percent <= 100:
            raise ValueError(f"every_percent must be in [1, 100], got {every_percent}")
        self.stream = stream
        self.every = every_percent
        self.tty = bool(getattr(stream, "isatty", lambda: False)()) if tty is None else tty
        self._phase: str | None = None
        self._next_mark = 0  # the next percent that earns a line (non-TTY)
        self._bar: Any = None

    # ------------------------------------------------------------------ listener
    def __call__(self, event: ProgressEvent) -> None:
        if self.tty:
            self._draw(event)
        else:
            self._log(event)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ------------------------------------------------------------------ terminal: tqdm
    def _draw(self, event: ProgressEvent) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=100, file=self.stream, disable=False, leave=True, dynamic_ncols=True,
                             bar_format="{percentage:3.0f}%|{bar}| {desc} [{elapsed}<{remaining}]")
        percent = int(event.progress * 100)
        if percent > self._bar.n:
            self._bar.update(percent - self._bar.n)
        self._bar.set_description_str(_describe(event), refresh=True)
        if event.terminal:
            self.close()

    # ------------------------------------------------------------------ logs: a line per phase and per N %
    def _log(self, event: ProgressEvent) -> None:
        percent = int(event.progress * 100)
        new_phase = event.phase != self._phase
        if not (new_phase or percent >= self._next_mark or event.terminal):
            return
        self._phase = event.phase
        while self._next_mark <= percent:
            self._next_mark += self.every
        eta = f" eta {event.eta_s:.1f}s" if event.eta_s is not None and not event.terminal else ""
        message = f": {event.message}" if event.terminal and event.message else ""
        self.stream.write(f"[{percent:3d}%] {_describe(event)} {event.elapsed_s:.1f}s{eta}{message}\n")
        self.stream.flush()
