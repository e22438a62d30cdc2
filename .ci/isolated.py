#!/usr/bin/env python3
"""Order-independence check (issue 14 §1): run each test directory on its own, its files in reverse order.

The normal run collects every directory together in file-name order, which can hide a test that only passes
because another module was imported first (e.g. ``from conftest import ...`` resolving to another directory's
conftest, or state left behind by an earlier test). Here every directory runs in its own pytest process, with
its test files listed in reverse, so such a dependency fails. Slow tests are deselected (the full run covers
them); a directory whose tests are all slow collects nothing (pytest exit 5), which is fine here.

Usage: python .ci/isolated.py [PYTEST_ARGS...]   (exit status 1 if any directory failed)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dirs() -> list[Path]:
    return sorted({p.parent for p in (ROOT / "tests").rglob("test_*.py")})


def main(extra: list[str]) -> int:
    failed = []
    for folder in test_dirs():
        files = sorted(folder.glob("test_*.py"), reverse=True)
        rel = folder.relative_to(ROOT)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
               "-m", "not slow", *extra, *(str(f.relative_to(ROOT)) for f in files)]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        ok = proc.returncode in (0, 5)
        print(f"{'ok ' if ok else 'FAIL'} {rel} ({len(files)} files, reversed) {time.monotonic() - t0:.0f} s: {summary}",
              flush=True)
        if not ok:
            failed.append(str(rel))
            sys.stdout.write(proc.stdout[-6000:] + proc.stderr[-3000:] + "\n")
    if failed:
        print(f"order-dependent or failing when run alone: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
