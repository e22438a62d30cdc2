"""Scheduler rules: admission-wait decisions at exact boundary times (docs/contracts-status.md C6), batching, queue."""

from __future__ import annotations

import math

import pytest
from omnicore.engine.scheduler import AdmissionDecision, Scheduler, admission_wait
from omnicore.errors import ConfigError, QueueFull


def sched(**kw) -> Scheduler:
    kw.setdefault("max_num_seqs", 2)
    kw.setdefault("max_queue", 16)
    kw.setdefault("request_batch_max_wait_ms", 1000)
    return Scheduler(**kw)


# ---------------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1, -0.001, "nan", "inf", "x"])
def test_max_wait_rejects_non_finite_and_negative(bad):
    with pytest.raises(ConfigError, match="request_batch_max_wait_ms.*finite non-negative") as info:
        sched(request_batch_max_wait_ms=bad)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("raw,expected", [(5, 5.0), (0, 0.0), (None, 0.0), ("250", 250.0), (2.5, 2.5)])
def test_max_wait_is_normalised_to_float(raw, expected):
    s = sched(request_batch_max_wait_ms=raw)
    assert s.max_wait_ms == expected and type(s.max_wait_ms) is float


# ---------------------------------------------------------------------------------------------- decisions


def test_decision_values_at_10():
    d = sched().get_admission_wait_decision(10.0)
    assert d == AdmissionDecision(should_wait=True, deadline=11.0, stable_window_s=0.05, max_batch=2)


def test_no_wait_when_max_wait_is_zero():
    d = sched(request_batch_max_wait_ms=0).get_admission_wait_decision(10.0)
    assert not d.should_wait and d.deadline is None


def test_no_wait_while_a_batch_runs():
    s = sched()
    s.running = True
    assert not s.get_admission_wait_decision(10.0).should_wait
    s.running = False
    assert s.get_admission_wait_decision(10.0).should_wait


def test_one_waiting_ends_on_stable_window_then_deadline():
    s = sched()
    s.add("a", key="k")
    d = s.get_admission_wait_decision(10.0)
    assert not s.should_end_admission_wait(d, 10.01, stable_since=10.0)
    assert not s.should_end_admission_wait(d, 10.049, stable_since=10.0)
    assert s.should_end_admission_wait(d, 10.05, stable_since=10.0)
    # a queue that just changed is not stable, but the deadline still ends the wait
    assert not s.should_end_admission_wait(d, 10.999, stable_since=10.98)
    assert s.should_end_admission_wait(d, 11.0, stable_since=10.99)


def test_full_batch_ends_at_once():
    s = sched()
    s.add("a", key="k")
    s.add("b", key="k")
    d = s.get_admission_wait_decision(10.0)
    assert s.should_end_admission_wait(d, 10.01, stable_since=10.0)


def test_full_batch_is_counted_in_outputs():
    s = sched(max_num_seqs=4)
    s.add("a", key="k", size=2)
    d = s.get_admission_wait_decision(10.0)
    assert not s.should_end_admission_wait(d, 10.01, stable_since=10.0)
    s.add("b", key="k", size=2)
    assert s.should_end_admission_wait(d, 10.01, stable_since=10.0)


def test_empty_queue_only_ends_at_deadline():
    s = sched()
    d = s.get_admission_wait_decision(10.0)
    assert not s.should_end_admission_wait(d, 10.9, stable_since=10.0)
    assert s.should_end_admission_wait(d, 11.0, stable_since=10.0)


# ---------------------------------------------------------------------------------------------- wait loop


class FakeClock:
    """A clock that only advances when the loop waits on the fake condition."""

    def __init__(self, start: float, sched: Scheduler, arrivals: dict[float, str]) -> None:
        self.now = start
        self.sched = sched
        self.arrivals = sorted(arrivals.items())
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, timeout: float) -> None:
        self.waits.append(timeout)
        self.now = round(self.now + timeout, 9)
        while self.arrivals and self.arrivals[0][0] <= self.now + 1e-12:
            self.sched.add(self.arrivals.pop(0)[1], key="k")


def run_wait(s: Scheduler, arrivals: dict[float, str]) -> tuple[float, FakeClock]:
    clock = FakeClock(10.0, s, arrivals)
    decision = s.get_admission_wait_decision(clock())
    waited = admission_wait(s, clock, decision, clock, lambda: False)
    return waited, clock


def test_wait_loop_leaves_after_stable_window_not_deadline():
    s = sched(max_num_seqs=8)
    s.add("a", key="k")
    waited, clock = run_wait(s, {})
    assert waited == pytest.approx(0.05, abs=1e-9)
    assert max(clock.waits) <= 0.002 + 1e-12


def test_wait_loop_restarts_stable_window_when_queue_grows():
    s = sched(max_num_seqs=8)
    s.add("a", key="k")
    waited, _ = run_wait(s, {10.03: "b"})
    assert waited == pytest.approx(0.08, abs=1e-9)


def test_wait_loop_ends_when_batch_fills():
    s = sched(max_num_seqs=2)
    s.add("a", key="k")
    waited, _ = run_wait(s, {10.01: "b"})
    assert waited == pytest.approx(0.01, abs=1e-9)


def test_wait_loop_ends_at_deadline_with_trickling_arrivals():
    s = sched(max_num_seqs=100, request_batch_max_wait_ms=100)
    s.add("a", key="k")
    arrivals = {round(10.0 + 0.02 * i, 6): f"r{i}" for i in range(1, 20)}  # never stable for 50 ms
    waited, clock = run_wait(s, arrivals)
    assert waited == pytest.approx(0.1, abs=1e-9)
    assert clock.waits[-1] <= 0.002


def test_wait_loop_stops_on_shutdown():
    s = sched()
    s.add("a", key="k")
    clock = FakeClock(10.0, s, {})
    d = s.get_admission_wait_decision(10.0)
    assert admission_wait(s, clock, d, clock, lambda: True) == 0.0


# ---------------------------------------------------------------------------------------------- batching


def test_fifo_batches_only_equal_keys_and_skipped_items_keep_their_place():
    s = sched(max_num_seqs=3)
    for item, key in [("a1", "A"), ("b1", "B"), ("a2", "A"), ("b2", "B"), ("a3", "A"), ("a4", "A")]:
        s.add(item, key=key)
    assert s.next_batch() == ["a1", "a2", "a3"]
    assert s.next_batch() == ["b1", "b2"]
    assert s.next_batch() == ["a4"]
    assert s.next_batch() == []


def test_quality_is_never_mixed_even_with_equal_keys():
    s = sched(max_num_seqs=4)
    s.add("d", key="k", quality="draft")
    s.add("h", key="k", quality="high")
    s.add("d2", key="k", quality="draft")
    assert s.next_batch() == ["d", "d2"]
    assert s.next_batch() == ["h"]


def test_batch_size_counts_outputs_and_oversized_request_runs_alone():
    s = sched(max_num_seqs=4)
    s.add("big", key="k", size=6)
    s.add("x3", key="k", size=3)
    s.add("y2", key="k", size=2)
    s.add("z1", key="k", size=1)
    assert s.next_batch() == ["big"]
    assert s.next_batch() == ["x3", "z1"]
    assert s.next_batch() == ["y2"]


def test_no_batching_when_model_does_not_support_it():
    s = sched(max_num_seqs=4, supports_batching=False)
    s.add("a", key="k")
    s.add("b", key="k")
    assert s.max_batch == 1
    d = s.get_admission_wait_decision(10.0)
    assert s.should_end_admission_wait(d, 10.0, stable_since=10.0)
    assert s.next_batch() == ["a"]
    assert s.next_batch() == ["b"]


def test_bounded_queue_raises_queue_full_and_drops_nothing():
    s = sched(max_queue=2)
    s.add("a", key="k")
    s.add("b", key="k")
    with pytest.raises(QueueFull) as info:
        s.add("c", key="k")
    assert info.value.limit == 2
    assert list(s) == ["a", "b"]
    assert s.remove("a") and not s.remove("a")
    s.add("c", key="k")
    assert list(s) == ["b", "c"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ConfigError):
        Scheduler(max_num_seqs=bad, max_queue=1)
    with pytest.raises(ConfigError):
        Scheduler(max_num_seqs=1, max_queue=bad)
