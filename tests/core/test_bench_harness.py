"""The benchmark harness (``benchmarks/_harness.py``) and collector (``benchmarks/run_all.py``): goal logic,
interleaved timing on a fake clock, crash records, and ``make bench``'s JSON + markdown collection driven by
tiny fake benchmark scripts in a temporary folder. No real benchmark runs here."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _harness  # noqa: E402
import run_all  # noqa: E402
from _harness import Case, Goal, quantile, ratio_at_least, ratio_at_most, static_case, within  # noqa: E402

# ---------------------------------------------------------------------------------------------- goals


@pytest.mark.parametrize("goal,value,expected", [
    (ratio_at_most(1.0), 1.0, True), (ratio_at_most(1.0), 1.0001, False),
    (ratio_at_least(1.5), 1.5, True), (ratio_at_least(1.5), 1.49, False),
    (within(1.0, 0.05), 1.04, True), (within(1.0, 0.05), 0.949, False),
    (ratio_at_most(1.0), math.nan, False), (ratio_at_most(1.0), math.inf, False),
    (ratio_at_most(1.0), True, False), (ratio_at_most(1.0), "0.5", False),
])
def test_goal_met(goal, value, expected):
    assert goal.met({"ratio": value}) is expected


def test_goal_reads_its_metric_and_a_missing_metric_is_not_met():
    goal = ratio_at_most(1.05, metric="cpu_ratio")
    assert goal.met({"ratio": 9.0, "cpu_ratio": 1.0})
    assert not goal.met({"ratio": 0.1})
    assert goal.describe() == "cpu_ratio <= 1.05"
    assert within(0, 0.05, "prediction_error").describe() == "prediction_error within 0 ± 0.05"


def test_goal_validation():
    with pytest.raises(ValueError):
        Goal("within", 1.0)
    with pytest.raises(ValueError):
        Goal("within", 1.0, tol=-1)
    with pytest.raises(ValueError):
        Goal("<", 1.0)


def test_static_case_ratio_and_combined_goals():
    record = static_case("mem", "resident", "cached", "plain", {"a_value": 61, "b_value": 100},
                         [ratio_at_most(0.62), Goal(">=", 100, "b_value")])
    assert record["ratio"] == pytest.approx(0.61)
    assert record["met"] is True and record["goal"] == "ratio <= 0.62 and b_value >= 100"
    assert static_case("mem", "c", "a", "b", {"a_value": 63, "b_value": 100}, ratio_at_most(0.62))["met"] is False


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_quantile_matches_numpy(q):
    xs = [5.0, 1.0, 4.0, 2.5, 9.0, 3.0]
    assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))
    assert math.isnan(quantile([], q))


# ---------------------------------------------------------------------------------------------- timing


class FakeClock:
    """``perf_counter``/``process_time`` replacement advanced only by the fake arms."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(_harness.time, "perf_counter", fake)
    monkeypatch.setattr(_harness.time, "process_time", fake)
    return fake


def test_case_interleaves_arms_and_reports_medians(clock):
    calls = []
    durations = {"a": iter([9.0, 9.0, 1.0, 1.0, 3.0, 5.0]), "b": iter([9.0, 9.0, 2.0, 2.0, 4.0, 8.0])}

    def arm(name):
        def run():
            calls.append(name)
            clock.now += next(durations[name])
            return name.upper()
        return run

    case = Case("bench", "case", "fast", "slow", arm("a"), arm("b"), goal=ratio_at_most(0.7), reps=4, warmup=2,
                compare=lambda a, b: {"outs": a + b}, extra=lambda: {"measured": 42})
    record = case.run()
    assert calls == ["a", "b", "a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then A B, B A ...
    assert record["a_median_s"] == 2.0 and record["b_median_s"] == 3.0  # medians of [1,1,3,5] and [2,2,4,8]
    assert record["ratio"] == pytest.approx(2 / 3) and record["cpu_ratio"] == pytest.approx(2 / 3)
    assert record["a_min_s"] == 1.0 and record["b_p90_s"] == pytest.approx(quantile([2, 2, 4, 8], 0.9))
    assert record["outs"] == "AB" and record["measured"] == 42
    assert record["met"] is True and record["goal"] == "ratio <= 0.7"
    assert (record["reps"], record["warmup"]) == (4, 2)


def test_a_self_timed_case_uses_the_span_each_arm_measured(clock):
    """Set-up and clean-up around the measured span (here 10 s of it per call) stay out of the medians."""
    spans = {"a": iter([1.0, 3.0, 2.0]), "b": iter([4.0, 6.0, 5.0])}

    def arm(name):
        def run():
            clock.now += 10.0
            return next(spans[name])
        return run

    record = Case("bench", "case", "a", "b", arm("a"), arm("b"), goal=ratio_at_most(0.5), reps=3, warmup=0,
                  self_timed=True).run()
    assert (record["a_median_s"], record["b_median_s"]) == (2.0, 5.0) and record["ratio"] == pytest.approx(0.4)
    bad = Case("bench", "case", "a", "b", lambda: "x", lambda: 1.0, goal=ratio_at_most(1), reps=1, warmup=0,
               self_timed=True)
    with pytest.raises(TypeError, match="measured seconds"):
        bad.run()


def test_case_rejects_bad_repetitions(clock):
    case = Case("b", "c", "a", "b", lambda: None, lambda: None, goal=ratio_at_most(1))
    with pytest.raises(ValueError):
        case.run(reps=0)
    with pytest.raises(ValueError):
        case.run(warmup=-1)


def test_main_prints_one_json_line_per_case_and_survives_a_crash(clock, capsys):
    def boom():
        raise RuntimeError("kaput")

    def tick():
        clock.now += 1.0

    cases = [Case("b", "good", "x", "y", tick, tick, goal=within(1.0, 0.01), reps=3, warmup=0),
             Case("b", "broken", "x", "y", boom, tick, goal=ratio_at_most(1)),
             static_case("b", "bytes", "x", "y", {"a_value": 1, "b_value": 2}, ratio_at_most(1))]
    assert _harness.main(cases, argv=[]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["case"] for r in records] == ["good", "broken", "bytes"]
    assert records[0]["ratio"] == 1.0 and records[0]["met"] is True
    assert records[1] == {"benchmark": "b", "case": "broken", "error": "RuntimeError: kaput", "met": False}
    assert _harness.main(cases, argv=["--case", "byt"]) == 0
    assert [json.loads(x)["case"] for x in capsys.readouterr().out.strip().splitlines()] == ["bytes"]


# ---------------------------------------------------------------------------------------------- run_all


SCRIPTS = {
    "alpha.py": """
        import json, sys
        print("a progress line on stdout that is not JSON")
        for case, ratio in (("one", 0.5), ("two", 2.0)):
            print(json.dumps({"benchmark": "alpha", "case": case, "arm_a": "ours", "arm_b": "ref",
                              "a_median_s": ratio, "b_median_s": 1.0, "ratio": ratio, "goal": "ratio <= 1",
                              "met": ratio <= 1, "argv": sys.argv[1:]}))
    """,
    "broken.py": """
        import json, sys
        print(json.dumps({"case": "partial", "a_value": 3, "b_value": 4, "ratio": 0.75, "met": True}))
        print("something went wrong", file=sys.stderr)
        sys.exit(3)
    """,
    "silent.py": "pass\n",
    "nocuda.py": """
        import json
        print(json.dumps({"benchmark": "nocuda", "case": "*", "skipped": "no CUDA: torch is a CPU-only build"}))
    """,
    "sleepy.py": "import time\ntime.sleep(30)\n",
    "_helper.py": "raise SystemExit('helpers are never run')\n",
}


@pytest.fixture
def fake_benchmarks(tmp_path, monkeypatch):
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    for name, source in SCRIPTS.items():
        (folder / name).write_text(textwrap.dedent(source))
    monkeypatch.setattr(run_all, "HERE", folder)
    return folder


def test_run_all_collects_json_and_writes_markdown(fake_benchmarks, tmp_path):
    results = tmp_path / "results"
    rc = run_all.main(["--results", str(results), "--timeout", "2", "--", "--reps", "3"])
    assert rc == 1  # broken, silent and sleepy did not finish cleanly
    report = json.loads((results / "latest.json").read_text())
    status = {s["script"]: s["status"] for s in report["scripts"]}
    assert status == {"alpha.py": "ok", "broken.py": "failed", "silent.py": "no-output", "sleepy.py": "timeout",
                      "nocuda.py": "skipped"}
    broken = next(s for s in report["scripts"] if s["script"] == "broken.py")
    assert broken["returncode"] == 3 and "something went wrong" in broken["stderr_tail"]
    cases = [(r["benchmark"], r["case"], r["script"]) for r in report["results"]]
    assert cases == [("alpha", "one", "alpha.py"), ("alpha", "two", "alpha.py"), ("broken", "partial", "broken.py")]
    assert report["results"][0]["argv"] == ["--reps", "3"]  # arguments after -- reach every script
    assert report["host"]["cpus"] and report["created"]

    md = (results / "latest.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| benchmark")]
    assert len(rows) == 3
    assert rows[0].split(" | ")[1:4] == ["one", "ours", "ref"] and "500 ms" in rows[0] and "| yes |" in rows[0]
    assert "**no**" in rows[1] and "0.750" in rows[2]
    assert "`sleepy.py`: timeout" in md and "`silent.py`: no-output" in md
    assert "## Skipped" in md and "`nocuda.py`: no CUDA: torch is a CPU-only build" in md
    assert "`nocuda.py`: skipped" not in md  # listed as skipped, not among the scripts that failed
    assert not list(results.glob(".*.part"))  # written atomically


def test_a_script_that_only_skips_does_not_fail_the_run(fake_benchmarks, tmp_path):
    """``make bench`` on a machine without CUDA: the GPU script's skip record keeps the run green."""
    results = tmp_path / "results"
    assert run_all.main(["--results", str(results), "--only", "alpha", "--only", "nocuda"]) == 0
    report = json.loads((results / "latest.json").read_text())
    assert [r["case"] for r in report["results"]] == ["one", "two"]  # skip records are not result rows
    skipped = next(s for s in report["scripts"] if s["script"] == "nocuda.py")
    assert skipped["skipped"] == "no CUDA: torch is a CPU-only build" and "stderr_tail" not in skipped


def test_gpu_kernels_prints_a_skip_record_without_cuda():
    import subprocess

    proc = subprocess.run([sys.executable, str(BENCH / "gpu_kernels.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    records, _ = run_all.parse_records(proc.stdout)
    assert len(records) == 1 and records[0]["benchmark"] == "gpu_kernels" and "no CUDA" in records[0]["skipped"]


def test_run_all_only_selects_scripts(fake_benchmarks, tmp_path):
    results = tmp_path / "results"
    assert run_all.main(["--results", str(results), "--only", "alpha"]) == 0
    report = json.loads((results / "latest.json").read_text())
    assert [s["script"] for s in report["scripts"]] == ["alpha.py"]
    assert run_all.main(["--results", str(results), "--only", "nothing-like-this"]) == 1


def test_parse_records_keeps_other_lines():
    records, other = run_all.parse_records('{"case": 1}\nnoise\n{broken json\n[1, 2]\n\n')
    assert records == [{"case": 1}]
    assert other == ["noise", "{broken json", "[1, 2]"]


def test_real_scripts_are_discovered_but_not_helpers():
    names = {p.name for p in run_all.discover([])}
    assert {"batching.py", "adaln_cache.py", "step_cache.py", "encode_outputs.py"} <= names
    assert not any(n.startswith("_") for n in names) and "run_all.py" not in names
