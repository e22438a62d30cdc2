#!/usr/bin/env bash
# One prepared GPU check: everything that needs a CUDA device, in one command, in under 8 minutes.
#
#   bash benchmarks/gpu_check.sh [--dry] [--out DIR] [--wheels DIR] [--python PY]   (or: make gpu-check)
#
# On a machine with one CUDA GPU it
#   1. makes a fresh venv that sees the machine's own CUDA torch (--system-site-packages) and installs every omnicore
#      distribution into it (from --wheels DIR with --no-index when the machine has no network: fill DIR beforehand
#      with `pip download` of what the machine lacks, for its Python and platform);
#   2. runs the CUDA backend's tests with Triton compiling for real (not interpreted) and every test marked `gpu`,
#      flash-attn's included when it imports (JUnit XML);
#   3. runs the GPU benchmark cases: benchmarks/gpu_kernels.py, benchmarks/compile.py (compiled vs eager) and
#      benchmarks/quantization.py (int8 / fp8 and the FP8 torch._scaled_mm linears vs bf16, at MiniMax-H3 width);
#   4. writes DIR/gpu_check.json and DIR/gpu_check.md: host and GPU, each step's status and seconds, test counts,
#      every benchmark record.
# --dry runs the same plumbing on a CPU-only machine (this repo's .venv, tests collected but not run, the GPU
# benchmark printing its skip record) so that the script itself is tested (`make test-slow` does) until a GPU is
# lent. Each step has a time limit; the whole check stops itself at 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

dry=0
out="${OUT:-$root/benchmarks/results/gpu_check}"
wheels=""
python=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) dry=1 ;;
    --out) out="$2"; shift ;;
    --wheels) wheels="$2"; shift ;;
    --python) python="$2"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
steps="$out/steps.jsonl"
: > "$steps"
deadline=$(( $(date +%s) + 480 ))

# step NAME LIMIT_S COMMAND...: runs it with a time limit (never past the deadline), logs to $out/NAME.log and
# records {"step", "status", "rc", "seconds"}.
step() {
  local name="$1" limit="$2"; shift 2
  local left=$(( deadline - $(date +%s) ))
  [ "$left" -lt "$limit" ] && limit="$left"
  if [ "$limit" -le 0 ]; then
    printf '{"step": "%s", "status": "not-run", "rc": null, "seconds": 0}\n' "$name" >> "$steps"
    return 1
  fi
  local start=$(date +%s.%N)
  if [ "$(type -t "$1")" = function ]; then  # a shell function: time-limited by a background watchdog
    ( "$@" ) > "$out/$name.log" 2>&1 &
    local pid=$! ; ( sleep "$limit"; kill -TERM "$pid" 2>/dev/null ) & local dog=$!
    wait "$pid"; local rc=$?
    kill "$dog" 2>/dev/null; wait "$dog" 2>/dev/null
    [ "$rc" -eq 143 ] && rc=124
  else
    timeout "$limit" "$@" > "$out/$name.log" 2>&1; local rc=$?
  fi
  local secs
  secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  local status=ok
  [ "$rc" -ne 0 ] && status=failed
  [ "$rc" -eq 124 ] && status=timeout
  printf '{"step": "%s", "status": "%s", "rc": %d, "seconds": %s}\n' "$name" "$status" "$rc" "$secs" >> "$steps"
  echo "gpu_check: $name: $status (${secs} s)" >&2
  return "$rc"
}

if [ "$dry" = 1 ]; then
  py="${python:-$root/.venv/bin/python}"
  [ -x "$py" ] || { echo "gpu_check --dry: $py is missing; run 'make install' first" >&2; exit 2; }
else
  base="${python:-python3}"
  venv="$(mktemp -d)/venv"
  step venv 120 "$base" -m venv --system-site-packages "$venv" || exit 1
  py="$venv/bin/python"
  pip_args=(-q --no-build-isolation)
  [ -n "$wheels" ] && pip_args+=(--no-index --find-links "$wheels")
  editable=(-e "core[serve,test]")
  for p in plugins/*/pyproject.toml; do editable+=(-e "$(dirname "$p")"); done
  step install 240 "$py" -m pip install "${pip_args[@]}" "${editable[@]}" || true
  step cuda_probe 60 "$py" -c 'import sys, torch; ok = torch.cuda.is_available(); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if ok else "no CUDA device"); sys.exit(0 if ok else 3)' \
    || { echo "gpu_check: no usable CUDA device (see $out/cuda_probe.log)" >&2; }
fi

collect=()
[ "$dry" = 1 ] && collect=(--collect-only)
# pytest's exit 5 (nothing selected: e.g. no gpu-marked test outside the backend) is not a failure here
run_pytest() { "$py" -m pytest "$@"; local rc=$?; [ "$rc" -eq 5 ] && return 0; return "$rc"; }
# the CUDA backend's whole suite (compiled Triton on a GPU), then every gpu-marked test elsewhere
step tests_backend_cuda 180 run_pytest -q -p no:cacheprovider "${collect[@]}" tests/plugins/backends_cuda \
  --junitxml "$out/tests_backend_cuda.xml"
step tests_gpu_marked 120 run_pytest -q -p no:cacheprovider "${collect[@]}" -m gpu tests \
  --ignore=tests/plugins/backends_cuda --junitxml "$out/tests_gpu_marked.xml"
bench_only=(--only gpu_kernels)
[ "$dry" = 1 ] || bench_only+=(--only compile --only quantization)
step benchmarks 240 "$py" benchmarks/run_all.py "${bench_only[@]}" --timeout 230 --results "$out/bench"

"$py" - "$out" "$dry" <<'EOF'
"""Fold the steps, the JUnit files and the benchmark records into gpu_check.json and gpu_check.md."""
import json
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
tests = {}
for xml in sorted(out.glob("tests_*.xml")):
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests[xml.stem] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    log = out / f"{xml.stem}.log"
    found = re.findall(r"(\d+)(?:/\d+)? tests? collected", log.read_text()) if log.exists() else []
    tests[xml.stem]["collected"] = int(found[-1]) if found else None
bench_file = out / "bench" / "latest.json"
bench = json.loads(bench_file.read_text()) if bench_file.exists() else {"results": [], "scripts": []}
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip() or None
except (OSError, subprocess.TimeoutExpired):
    gpu = None
report = {"dry": dry, "host": {"python": platform.python_version(), "machine": platform.machine(), "gpu": gpu},
          "steps": steps, "tests": tests, "benchmarks": bench.get("results", []),
          "benchmark_scripts": bench.get("scripts", [])}
(out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
lines = [f"# GPU check{' (dry run: plumbing only, no GPU)' if dry else ''}", "",
         f"GPU: {gpu or 'none'}; Python {platform.python_version()}", "",
         "| step | status | seconds |", "|---|---|---|"]
lines += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in steps]
lines += ["", "| tests | collected | run | failures | errors | skipped |", "|---|---|---|---|---|---|"]
lines += [f"| {k} | {v['collected']} | {v['tests']} | {v['failures']} | {v['errors']} | {v['skipped']} |"
          for k, v in tests.items()]
lines += ["", "| benchmark | case | ratio | goal | met |", "|---|---|---|---|---|"]
lines += [f"| {r.get('benchmark')} | {r.get('case')} | {r.get('ratio', '–')} | {r.get('goal', '')} | {r.get('met')} |"
          for r in bench.get("results", [])]
skipped = [s for s in bench.get("scripts", []) if s.get("status") == "skipped"]
lines += [""] + [f"- skipped `{s['script']}`: {s.get('skipped', '')}" for s in skipped]
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
print(f"gpu_check: wrote {out / 'gpu_check.json'} and gpu_check.md", file=sys.stderr)
EOF
failed=$(grep -c '"status": "\(failed\|timeout\|not-run\)"' "$steps")
exit $(( failed > 0 ? 1 : 0 ))
