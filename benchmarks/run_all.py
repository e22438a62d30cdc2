"""Run every benchmark script in its own process and collect the results (``make bench``).

Discovers ``benchmarks/*.py`` (except ``_*.py`` helpers and this file), runs each with a timeout, keeps the JSON
lines each prints on stdout (one object per case), and writes ``benchmarks/results/latest.json`` plus a markdown
table ``benchmarks/results/latest.md``. A script that crashes or times out is recorded as such; the others still
run. A script that prints only skip records (``_harness.skipped``: no CUDA device, a package missing) is listed as
skipped with its reason. Exit status: 1 if any script failed, else 0 (goals that are not met and skipped scripts are
reported, not failures).

    python benchmarks/run_all.py [--only NAME ...] [--timeout S] [-- ARGS FOR EVERY SCRIPT, e.g. --reps 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import environment  # noqa: E402

SKIP = {"run_all.py"}
STDERR_TAIL = 4000


def discover(only: list[str]) -> list[Path]:
    scripts = [p for p in sorted(HERE.glob("*.py")) if not p.name.startswith("_") and p.name not in SKIP]
    if only:
        scripts = [p for p in scripts if p.stem in only or p.name in only]
    return scripts


def parse_records(stdout: str) -> tuple[list[dict], list[str]]:
    """JSON objects from the script's stdout; other lines are returned separately (kept for diagnosis)."""
    records, other = [], []
    for line in stdout.splitlines():
        text = line.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                other.append(line)
                continue
            if isinstance(obj, dict):
                records.append(obj)
                continue
        if text:
            other.append(line)
    return records, other


def run_script(path: Path, timeout: float, extra_args: list[str]) -> tuple[dict, list[dict]]:
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(
            [sys.executable, str(path), *extra_args],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired as exc:
        to_text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr, rc, status = to_text(exc.stdout), to_text(exc.stderr), None, "timeout"
    records, other = parse_records(stdout)
    for record in records:
        record.setdefault("benchmark", path.stem)
        record["script"] = path.name
    skips = [r for r in records if "skipped" in r]
    records = [r for r in records if "skipped" not in r]
    if status == "ok" and skips and not records:
        status = "skipped"
    elif status == "ok" and not records:
        status = "no-output"
    info = {
        "script": path.name,
        "status": status,
        "returncode": rc,
        "seconds": round(time.perf_counter() - start, 3),
        "cases": len(records),
    }
    if skips:
        info["skipped"] = "; ".join(str(r["skipped"]) for r in skips)
    if status not in ("ok", "skipped"):
        info["stderr_tail"] = stderr[-STDERR_TAIL:]
        info["stdout_other"] = "\n".join(other)[-STDERR_TAIL:]
    return info, records


def _fmt_seconds(value) -> str:
    if not isinstance(value, (int, float)):
        return "–"
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


def _fmt_ratio(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "–"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(report: dict) -> str:
    lines = [
        f"# Benchmark results ({report['created']})",
        "",
        "Host: " + ", ".join(f"{k} {v}" for k, v in report["host"].items()),
        "",
        "ratio = A median / B median (below 1: arm A is faster or smaller).",
        "",
        "| benchmark | case | arm A | arm B | A median | B median | ratio | goal | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "error" in r:
            met = f"error: {r['error']}"
        else:
            met = "yes" if r.get("met") else "**no**"
        a = r.get("a_median_s", r.get("a_value"))
        b = r.get("b_median_s", r.get("b_value"))
        timed = "a_median_s" in r
        lines.append(
            "| "
            + " | ".join(
                _cell(x)
                for x in (
                    r.get("benchmark", "?"),
                    r.get("case", "?"),
                    r.get("arm_a", ""),
                    r.get("arm_b", ""),
                    _fmt_seconds(a) if timed else a if a is not None else "–",
                    _fmt_seconds(b) if timed else b if b is not None else "–",
                    _fmt_ratio(r.get("ratio")),
                    r.get("goal", ""),
                    met,
                )
            )
            + " |"
        )
    skipped = [s for s in report["scripts"] if s["status"] == "skipped"]
    if skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- `{s['script']}`: {s.get('skipped', '')}" for s in skipped]
    bad = [s for s in report["scripts"] if s["status"] not in ("ok", "skipped")]
    if bad:
        lines += ["", "## Scripts that did not finish cleanly", ""]
        lines += [f"- `{s['script']}`: {s['status']} (rc {s['returncode']}, {s['seconds']} s)" for s in bad]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="script name (stem) to run; repeatable")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per script (default 900)")
    parser.add_argument("--results", type=Path, default=HERE / "results", help="output folder")
    args = parser.parse_args(argv)

    scripts = discover(args.only)
    if not scripts:
        print("no benchmark scripts matched", file=sys.stderr)
        return 1
    report = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": environment(),
        "results": [],
        "scripts": [],
    }
    for i, path in enumerate(scripts, 1):
        print(f"[{i}/{len(scripts)}] {path.name} ...", file=sys.stderr, flush=True)
        info, records = run_script(path, args.timeout, passthrough)
        report["scripts"].append(info)
        report["results"].extend(records)
        met = sum(1 for r in records if r.get("met"))
        print(f"    {info['status']}: {len(records)} cases, {met} goals met, {info['seconds']} s", file=sys.stderr)

    args.results.mkdir(parents=True, exist_ok=True)
    write_atomic(args.results / "latest.json", json.dumps(report, indent=2, default=str) + "\n")
    write_atomic(args.results / "latest.md", to_markdown(report))
    print(f"wrote {args.results / 'latest.json'} and latest.md", file=sys.stderr)
    return 1 if any(s["status"] not in ("ok", "skipped") for s in report["scripts"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
