"""Startup cost of the CLI: ``omnicore --help`` and ``omnicore plugins`` vs ``python -c "import diffusers"``.

Each arm is a fresh subprocess (the installed ``omnicore`` console script, the same interpreter for the
reference), timed wall-clock, interleaved with the reference by the shared harness. Goal: ours <= 0.2x of the
reference — listing plugins must never pay for the GPU stack. To see where
time goes: ``python -X importtime -m omnicore.cli.main plugins 2>&1 | sort -t'|' -k2 -n | tail``.

    python benchmarks/startup.py [--reps 7] [--warmup 1]
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, main, ratio_at_most  # noqa: E402

OMNICORE = str(Path(sys.executable).with_name("omnicore"))
ENV = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}


def _runner(argv: list[str]):
    def run() -> int:
        proc = subprocess.run(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv} exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
        return proc.returncode

    return run


def cases():
    reference = _runner([sys.executable, "-c", "import diffusers"])
    for case, argv in (("omnicore --help", [OMNICORE, "--help"]),
                       ("omnicore plugins", [OMNICORE, "plugins"])):
        yield Case("startup", case, "omnicore", "import diffusers", _runner(argv), reference,
                   goal=ratio_at_most(0.2), reps=7, warmup=1)


if __name__ == "__main__":
    raise SystemExit(main(cases))
