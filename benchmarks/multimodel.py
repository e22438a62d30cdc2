"""Several models per server: time to the first denoise step of a request whose model is offloaded vs loaded vs a
cold start (``omnicore.ModelPool``).

For one model M, each arm measures from ``submit`` to the event of M's first completed denoise step itself (the
harness's ``self_timed``: putting the other model back in before an ``offloaded`` repetition, cancelling the job after
its first step and closing a cold pool are outside the span):

* ``offloaded``: a pool with room for one model holds M and a second model F; F ran last, so M is offloaded to host
  memory. The time includes offloading F (idle) and restoring M, then M's encode and first step.
* ``loaded``: M is resident (a pool with room for both).
* ``cold``: a new pool with M only, built from the checkpoint on disk (the Engine load a server start pays, the
  operating system's file cache warm), then the request.
* ``cold process``: a new Python process that imports omnicore, loads M and runs the request (what restarting a
  one-model server per model costs), timed from spawn to the first step.

Cases: ``tiny:lingbot`` and a mid-size LingBot DiT (hidden 768, 8 blocks, ~85 M parameters; the tiny text encoder
and VAE). Goal: offloaded <= 0.3x cold at the tiny size. On the CPU platform the device is the host, so offloading
keeps the tensors aside without a copy and a restore is nearly free; on an accelerator a restore is a host-to-device
copy of the weights from pinned memory (not measured here). Outputs of tiny checkpoints are noise.

    python benchmarks/multimodel.py [--reps N] [--case tiny|mid]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, main, ratio_at_most, skipped  # noqa: E402

MID_DIT = dict(hidden_size=768, depth=8, num_attention_heads=8, intermediate_size=3072, in_channels=4, out_channels=4,
               text_dim=32, freq_dim=32, axes_dims=[32, 32, 32], axes_lens=[64, 64, 64], patch_size=[1, 2, 2])
CACHE = Path(os.environ.get("OMNICORE_BENCH_CACHE", Path(tempfile.gettempdir()) / "omnicore-bench-multimodel"))

#: a small request, so the first step's own compute does not drown what the arms differ in (where the weights are)
REQUEST = dict(num_inference_steps=2, seed=0, height=32, width=32, num_frames=1)

_CHILD = f"""
import sys, time, threading
from omnicore.config import Settings
from omnicore.engine.api import Engine, make_request
engine = Engine(sys.argv[1], settings=Settings(cache_dir=sys.argv[2]))
first = threading.Event()
job = engine.submit(make_request("a fox in the snow", **{REQUEST!r}),
                    on_event=lambda ev: first.set() if ev.phase == "denoise" and ev.step >= 1 else None)
first.wait(600)
print("FIRST_STEP", flush=True)
job.cancel()
engine.close(cancel_running=True, timeout=30)
"""


def _settings() -> Any:
    from omnicore.config import Settings

    return Settings(cache_dir=str(CACHE))


def _checkpoints() -> dict[str, str]:
    """``{case: checkpoint}``: the tiny preset (built once) and the mid-size DiT in the tiny preset's layout."""
    from omnicore.engine.loading import resolve_model
    from omnicore.plugin_host.host import default_host

    tiny = str(resolve_model("tiny:lingbot", default_host(), _settings()).path)
    mid = CACHE / "mid-lingbot"
    if not (mid / "model_index.json").exists():
        from omni_lingbot.presets import build_tiny

        build_tiny(mid, MID_DIT, seed=0)
    return {"tiny": tiny, "mid": str(mid)}


def _first_step(pool: Any, model: str) -> float:
    """Seconds from submit to ``model``'s first completed denoise step (the job is cancelled after it)."""
    from omnicore.engine.api import make_request

    first = threading.Event()
    t0 = time.perf_counter()
    job = pool.submit(make_request("a fox in the snow", **REQUEST), model=model,
                      on_event=lambda ev: first.set() if ev.phase == "denoise" and ev.step >= 1 else None)
    if not first.wait(600):
        raise RuntimeError(f"no first step of {model} within 600 s (job {job.status}: {job.error})")
    dt = time.perf_counter() - t0
    job.cancel()
    job.wait(60)
    pool.wait_idle(60)
    return dt


def _pool(checkpoints: dict[str, str], budget: int | None) -> Any:
    from omnicore.pool import ModelEntry, ModelPool

    return ModelPool([ModelEntry(name=n, checkpoint=c) for n, c in checkpoints.items()], settings=_settings(),
                     memory_budget=budget)


def _run_pool(checkpoint: str, filler: str) -> tuple[Any, Any, int]:
    one = _pool({"m": checkpoint}, None)
    size = one.status()["m"].size_bytes
    one.close()
    swapping = _pool({"m": checkpoint, "f": filler}, size + size // 2 if size > 0 else None)
    roomy = _pool({"m": checkpoint, "f": filler}, None)
    return swapping, roomy, size


def cases() -> Any:
    try:
        import omni_lingbot  # noqa: F401
    except ImportError:
        yield skipped("multimodel", "the LingBot plugin (plugins/lingbot) is not installed")
        return
    checkpoints = _checkpoints()
    wanted = [sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--case"]  # (main() filters too)
    for name, checkpoint in checkpoints.items():
        if wanted and not any(w in f"{name}:" for w in wanted):
            continue
        filler = checkpoint  # a second model of the same size: the budget holds exactly one of them
        swapping, roomy, size = _run_pool(checkpoint, filler)
        swapping.load("f")  # room for one: m goes out
        swapping.wait_idle(60)

        def offloaded(pool: Any = swapping) -> float:
            if pool.state_of("m") != "offloaded":
                pool.load("f")
                pool.wait_idle(60)
            assert pool.state_of("m") == "offloaded"
            return _first_step(pool, "m")

        def loaded(pool: Any = roomy) -> float:
            assert pool.state_of("m") == "loaded"
            return _first_step(pool, "m")

        def cold(checkpoint: str = checkpoint) -> float:
            t0 = time.perf_counter()
            pool = _pool({"m": checkpoint}, None)
            try:
                return time.perf_counter() - t0 + _first_step(pool, "m")
            finally:
                pool.close(cancel_running=True)

        def cold_process(checkpoint: str = checkpoint) -> float:
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, checkpoint, str(CACHE)], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("FIRST_STEP"):
                    break
            dt = time.perf_counter() - t0
            proc.wait(120)
            return dt

        reps = 5 if name == "tiny" else 3
        extra = {"model_bytes": size, "platform": swapping.platform.name,
                 "note": "CPU: offload keeps tensors aside without a copy" if swapping.platform.name == "cpu" else ""}
        yield Case("multimodel", f"{name}: offloaded vs cold", "offloaded", "cold (new pool, same process)",
                   offloaded, cold, goal=ratio_at_most(0.3), reps=reps, warmup=1, extra=extra, self_timed=True)
        yield Case("multimodel", f"{name}: loaded vs offloaded", "loaded", "offloaded", loaded, offloaded,
                   goal=ratio_at_most(1.05), reps=reps, warmup=1, extra=extra, self_timed=True)
        yield Case("multimodel", f"{name}: offloaded vs cold process", "offloaded", "cold process (spawn, import, "
                   "load)", offloaded, cold_process, goal=ratio_at_most(0.3), reps=max(2, reps - 2), warmup=0,
                   extra=extra, self_timed=True)
        swapping.close()
        roomy.close()


if __name__ == "__main__":
    raise SystemExit(main(cases))
