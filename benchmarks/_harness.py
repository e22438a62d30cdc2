"""Shared side-by-side benchmark harness.

A :class:`Case` times two arms — ours vs a reference, cached vs uncached, batched vs one-by-one — *interleaved*
(A B, then B A, ...) so drift in clock speed, caches or background load hits both arms alike. After warm-up it
reports each arm's wall-clock median, p90 and min, the ratio of medians ``a/b``, the same for CPU time of the
process (``cpu_ratio``: steadier than wall time on a shared machine for CPU-bound work, meaningless for GPU
work), the goal and whether it is met, and prints one JSON object per case on stdout (see benchmarks/README.md).
Progress goes to stderr.

Usage in a benchmark script::

    from _harness import Case, main, ratio_at_most

    def cases():
        yield Case("encode_outputs", "mp4_9f", "ours", "pyav_loop", run_ours, run_ref, goal=ratio_at_most(1.05))

    if __name__ == "__main__":
        raise SystemExit(main(cases))
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

_OPS = ("<=", ">=", "within")


@attrs.define(frozen=True)
class Goal:
    """A target on one number of the result record: ``record[metric] <= value``, ``>= value``, or
    ``|record[metric] - value| <= tol`` (``op="within"``). ``metric`` defaults to the ratio of medians."""

    op: str = attrs.field(validator=attrs.validators.in_(_OPS))
    value: float
    metric: str = "ratio"
    tol: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.op == "within" and (self.tol is None or self.tol < 0):
            raise ValueError("a 'within' goal needs tol >= 0")

    def describe(self) -> str:
        if self.op == "within":
            return f"{self.metric} within {self.value:g} ± {self.tol:g}"
        return f"{self.metric} {self.op} {self.value:g}"

    def met(self, record: Mapping[str, Any]) -> bool:
        got = record.get(self.metric)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
            return False
        if self.op == "<=":
            return got <= self.value
        if self.op == ">=":
            return got >= self.value
        return abs(got - self.value) <= self.tol


def ratio_at_most(value: float, metric: str = "ratio") -> Goal:
    return Goal("<=", value, metric)


def ratio_at_least(value: float, metric: str = "ratio") -> Goal:
    return Goal(">=", value, metric)


def within(value: float, tol: float, metric: str = "ratio") -> Goal:
    return Goal("within", value, metric, tol)


def quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) without needing numpy."""
    xs = sorted(samples)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@attrs.define
class Case:
    """Two arms to compare. ``run_a``/``run_b`` take no arguments; whatever they return is passed to ``compare``
    (from the last repetition) which may add fields such as ``"identical": True`` to the record. ``extra`` adds
    fixed fields, or is a callable evaluated after timing (e.g. measured memory). ``sync`` runs after every call
    inside the timed region (e.g. ``torch.cuda.synchronize``) so asynchronous work is counted. With ``self_timed``
    each arm returns the seconds it measured itself (a span inside the call, e.g. submit to first step, without the
    set-up and clean-up around it), and that span replaces the wall time of the call."""

    benchmark: str
    case: str
    arm_a: str
    arm_b: str
    run_a: Callable[[], Any]
    run_b: Callable[[], Any]
    goal: Goal | Sequence[Goal]
    reps: int = 15
    warmup: int = 2
    sync: Callable[[], None] | None = None
    compare: Callable[[Any, Any], Mapping[str, Any]] | None = None
    extra: Mapping[str, Any] | Callable[[], Mapping[str, Any]] = attrs.Factory(dict)
    self_timed: bool = False

    @property
    def goals(self) -> tuple[Goal, ...]:
        return (self.goal,) if isinstance(self.goal, Goal) else tuple(self.goal)

    def _timed(self, fn: Callable[[], Any]) -> tuple[float, float, Any]:
        """Wall seconds, CPU seconds of this process (all threads) and the result of one call."""
        cpu0, start = time.process_time(), time.perf_counter()
        result = fn()
        if self.sync is not None:
            self.sync()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        if self.self_timed:
            if not isinstance(result, (int, float)) or isinstance(result, bool) or result < 0:
                raise TypeError(f"{self.case}: a self-timed arm must return its measured seconds, got {result!r}")
            wall = float(result)
        return wall, cpu, result

    def run(self, reps: int | None = None, warmup: int | None = None) -> dict[str, Any]:
        reps = self.reps if reps is None else reps
        warmup = self.warmup if warmup is None else warmup
        if reps < 1 or warmup < 0:
            raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps} warmup={warmup}")
        for _ in range(warmup):
            self._timed(self.run_a)
            self._timed(self.run_b)
        wall: dict[str, list[float]] = {"a": [], "b": []}
        cpu: dict[str, list[float]] = {"a": [], "b": []}
        outs: dict[str, Any] = {"a": None, "b": None}
        for i in range(reps):
            order = (("a", self.run_a), ("b", self.run_b))
            for arm, fn in order if i % 2 == 0 else order[::-1]:  # A B, B A, A B, ...
                dt, dcpu, outs[arm] = self._timed(fn)
                wall[arm].append(dt)
                cpu[arm].append(dcpu)
        return self._record(wall, cpu, outs["a"], outs["b"], reps, warmup)

    def _record(self, wall: dict, cpu: dict, out_a: Any, out_b: Any, reps: int, warmup: int) -> dict:
        ta, tb = wall["a"], wall["b"]
        a_med, b_med = statistics.median(ta), statistics.median(tb)
        a_cpu, b_cpu = statistics.median(cpu["a"]), statistics.median(cpu["b"])
        record: dict[str, Any] = {
            "benchmark": self.benchmark,
            "case": self.case,
            "arm_a": self.arm_a,
            "arm_b": self.arm_b,
            "a_median_s": a_med,
            "b_median_s": b_med,
            "ratio": a_med / b_med if b_med > 0 else math.inf,
            "a_p90_s": quantile(ta, 0.9),
            "b_p90_s": quantile(tb, 0.9),
            "a_min_s": min(ta),
            "b_min_s": min(tb),
            "a_cpu_median_s": a_cpu,
            "b_cpu_median_s": b_cpu,
            "cpu_ratio": a_cpu / b_cpu if b_cpu > 0 else math.inf,
            "reps": reps,
            "warmup": warmup,
        }
        if self.compare is not None:
            record.update(self.compare(out_a, out_b))
        record.update(self.extra() if callable(self.extra) else self.extra)
        goals = self.goals
        record["goal"] = " and ".join(g.describe() for g in goals)
        record["met"] = all(g.met(record) for g in goals)
        return record


def static_case(benchmark: str, case: str, arm_a: str, arm_b: str, fields: Mapping[str, Any], goal) -> dict:
    """A record for a measured quantity that is not a timing (e.g. resident bytes): ``fields`` must hold
    ``a_value``/``b_value``; ratio = a/b. Printed like any other case so run_all collects it."""
    a, b = fields["a_value"], fields["b_value"]
    record = {"benchmark": benchmark, "case": case, "arm_a": arm_a, "arm_b": arm_b, **fields}
    record["ratio"] = a / b if b else math.inf
    goals = (goal,) if isinstance(goal, Goal) else tuple(goal)
    record["goal"] = " and ".join(g.describe() for g in goals)
    record["met"] = all(g.met(record) for g in goals)
    return record


def environment() -> dict[str, Any]:
    """Host facts worth keeping beside numbers (no heavy imports: torch only if already loaded)."""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    if "torch" in sys.modules:
        env["torch"] = sys.modules["torch"].__version__
    return env


def skipped(benchmark: str, reason: str) -> dict:
    """The record a benchmark prints instead of measurements when its hardware or package is absent.

    ``run_all`` counts a script whose every record is a skip as *skipped* (listed with its reason, not a failure),
    so ``make bench`` stays green on machines without, e.g., a CUDA device.
    """
    return {"benchmark": benchmark, "case": "*", "skipped": reason}


def emit(record: Mapping[str, Any]) -> None:
    """One JSON object per line on stdout (the contract run_all.py parses)."""
    print(json.dumps(record, sort_keys=False, default=str), flush=True)


def main(cases: Callable[[], Iterable[Case | dict]] | Iterable[Case | dict], argv: Sequence[str] | None = None) -> int:
    """Run the cases (optionally filtered with ``--case``), print one JSON line each; returns 1 if a case crashed.

    ``cases`` may yield ready-made dicts (from :func:`static_case`) as well as :class:`Case` objects.
    """
    parser = argparse.ArgumentParser(description="side-by-side benchmark (prints one JSON object per case)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per arm (default: per case)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed warm-up calls per arm (default: per case)")
    parser.add_argument("--case", action="append", default=[], help="run only cases whose name contains this")
    args = parser.parse_args(argv)
    failed = 0
    items = cases() if callable(cases) else cases
    for item in items:
        name = item.case if isinstance(item, Case) else item.get("case", "?")
        if args.case and not any(sub in name for sub in args.case):
            continue
        start = time.perf_counter()
        try:
            record = item.run(args.reps, args.warmup) if isinstance(item, Case) else dict(item)
        except Exception as exc:  # one broken case must not hide the others' numbers
            failed += 1
            traceback.print_exc()
            bench = item.benchmark if isinstance(item, Case) else item.get("benchmark", "?")
            record = {"benchmark": bench, "case": name, "error": f"{type(exc).__name__}: {exc}", "met": False}
        emit(record)
        print(f"  {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return 1 if failed else 0
