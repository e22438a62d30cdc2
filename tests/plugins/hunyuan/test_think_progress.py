"""The text stage through the engine: a ``think`` progress phase with token counts, and a cancel that stops the
stage between tokens (random weights: the text is noise; the mechanics are what is checked)."""

from __future__ import annotations

import threading

import pytest
from omnicore.engine.api import Engine, make_request
from omnicore.errors import Cancelled
from omnicore.plugin_host.host import default_host

PARAMS = {"height": 64, "width": 64, "num_inference_steps": 1, "guidance_scale": 1.0, "seed": 5}


@pytest.fixture(scope="module")
def engine(micro_dir):
    with Engine(str(micro_dir), settings=default_host().settings) as eng:
        yield eng


def test_think_reports_tokens_then_denoise(engine):
    events = []
    job = engine.submit(make_request("a fox", **PARAMS, extra={"bot_task": "think", "max_new_tokens": 5}),
                        on_event=events.append)
    out = job.result(300)[0]
    phases = [e.phase for e in events]
    think = [e for e in events if e.phase == "think"]
    assert think, phases
    assert phases.index("encode") < phases.index("think") < phases.index("denoise")
    assert [e.step for e in think] == sorted(e.step for e in think) and think[-1].total_steps == 5
    assert think[-1].step == out.metrics["text_tokens"]  # the last report is the text the image stage sees
    assert all(1 <= e.step <= 5 for e in think)
    progress = [e.progress for e in events]
    assert progress == sorted(progress)  # the think fractions sit between encode and denoise


def test_a_request_without_text_has_no_think_phase(engine):
    events = []
    engine.submit(make_request("a fox", **PARAMS), on_event=events.append).result(300)
    assert "think" not in [e.phase for e in events]


def test_cancel_during_think_stops_within_one_token(engine):
    """The engine opens a cancel scope around encode: a DELETE during the text stage ends the job cancelled after
    at most one more token, long before the budget."""
    events: list = []
    asked = threading.Event()
    box: dict = {}

    def listen(ev):
        events.append(ev)
        if ev.phase == "think" and ev.step >= 2 and not asked.is_set():
            asked.set()
            box["at"] = ev.step
            box["job"].cancel()

    budget = 400
    job = engine.submit(make_request("a fox", **PARAMS, extra={"bot_task": "think", "max_new_tokens": budget}),
                        on_event=lambda ev: box.get("job") and listen(ev))
    box["job"] = job
    with pytest.raises(Cancelled):
        job.result(300)
    think = [e.step for e in events if e.phase == "think"]
    assert asked.is_set() and max(think) <= box["at"] + 1 < budget, think
    assert job.status == "cancelled" and "denoise" not in [e.phase for e in events]
