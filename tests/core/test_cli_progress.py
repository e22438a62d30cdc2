"""``omnicore generate`` progress: a line per phase and per 10 % in logs, a tqdm bar on a terminal (issue 14 §4)."""

from __future__ import annotations

import io

import pytest
from omnicore.cli.progress import ProgressPrinter
from omnicore.engine.progress import ProgressEvent, phase_progress


def _events(steps: int = 40) -> list[ProgressEvent]:
    """What a job emits: preprocess, queued, encode, one event per denoise step, decode, postprocess, done."""
    out = [ProgressEvent("j", phase, progress=phase_progress(phase)) for phase in ("preprocess", "queued", "encode")]
    out += [ProgressEvent("j", "denoise", step=i, total_steps=steps, elapsed_s=0.1 * i, eta_s=0.1 * (steps - i),
                          progress=phase_progress("denoise", i, steps)) for i in range(1, steps + 1)]
    out += [ProgressEvent("j", p, step=steps, total_steps=steps, progress=phase_progress(p))
            for p in ("decode", "postprocess", "done")]
    return out


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_logs_get_a_line_per_phase_and_every_ten_percent():
    stream = io.StringIO()
    printer = ProgressPrinter(stream)
    events = _events(40)
    for ev in events:
        printer(ev)
    lines = stream.getvalue().splitlines()
    assert len(lines) <= 7 + 10  # 46 events: one line per phase (7) plus at most one per 10 %, not 46 lines
    phases = [line.split("] ")[1].split()[0] for line in lines]
    for phase in ("preprocess", "queued", "encode", "denoise", "decode", "postprocess", "done"):
        assert phase in phases, phase  # every phase change is visible
    percents = [int(line[1:4]) for line in lines if " denoise " in line]
    assert all(b // 10 > a // 10 for a, b in zip(percents, percents[1:]))  # each later line crosses a new 10 %
    assert lines[-1].startswith("[100%] done")
    assert "\r" not in stream.getvalue()


def test_every_percent_is_configurable_and_a_failure_says_why():
    stream = io.StringIO()
    printer = ProgressPrinter(stream, every_percent=50)
    for ev in _events(40)[:20]:
        printer(ev)
    printer(ProgressEvent("j", "failed", progress=0.3, message="out of memory"))
    text = stream.getvalue()
    assert text.count(" denoise ") == 1 and text.rstrip().endswith("failed 0.0s: out of memory")
    with pytest.raises(ValueError):
        ProgressPrinter(stream, every_percent=0)


def test_a_terminal_gets_a_tqdm_bar_even_when_third_party_bars_are_silenced(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")  # what cli.quiet sets for diffusers/transformers bars
    stream = _Tty()
    printer = ProgressPrinter(stream)
    for ev in _events(10):
        printer(ev)
    text = stream.getvalue()
    assert "\r" in text and "100%|" in text and "done step 10/10" in text
    assert printer._bar is None  # closed at the terminal event


def test_think_lines_count_tokens_not_steps():
    stream = io.StringIO()
    printer = ProgressPrinter(stream)
    printer(ProgressEvent("j", "encode", progress=phase_progress("encode")))
    for i in (1, 2, 3):
        printer(ProgressEvent("j", "think", step=i, total_steps=8, progress=phase_progress("think", i, 8)))
    printer(ProgressEvent("j", "denoise", step=1, total_steps=4, progress=phase_progress("denoise", 1, 4)))
    text = stream.getvalue()
    assert "think 1/8 tokens" in text and "step 1/8" not in text and "denoise step 1/4" in text
    assert phase_progress("encode") < phase_progress("think", 1, 8) < phase_progress("think", 8, 8)
    assert phase_progress("think", 8, 8) <= phase_progress("denoise", 0, 4)
