"""``omnicore plan MODEL``: which placements fit on the devices, before any weight is loaded.

Reads configs (and safetensors headers, never tensor data), builds the model on the meta device through the
plugin's own builders and prints, per placement, the bytes each rank holds and whether they fit
(:mod:`omnicore.planning`). ``--json`` prints the schema of ``docs/plan-json.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from ..errors import InvalidRequest

GIB = 1024 ** 3


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "plan", help="what fits where: per-rank memory of each placement, before loading", allow_abbrev=False,
        description="Plan a model's placement from its configs and safetensors headers alone (no weights are "
                    "read): per rank, the weight bytes of each component, an activation estimate for the request "
                    "and whether it fits, for one device, offload, ulysses, cfg, tp and ep (where the model "
                    "declares them), each with int8/fp8 weight-only quantization; the row --parallel auto would "
                    "pick is marked.")
    p.add_argument("model", help="real:<model> (the released configs, no weights), tiny:<preset>, a local "
                                 "checkpoint directory, or a Hub repository org/name[@revision] (its configs and "
                                 "safetensors headers only, over HTTP range reads)")
    p.add_argument("--devices", type=int, default=1, metavar="N", help="devices available (default: 1)")
    p.add_argument("--device-memory", type=float, default=80.0, metavar="GIB",
                   help="memory of each device in GiB (default: 80)")
    p.add_argument("--request", default="{}", metavar="JSON",
                   help='the request to size, as JSON of sampling fields plus "extra", e.g. \'{"duration": 5, '
                        '"extra": {"aspect_ratio": "16:9"}}\' (default: the model\'s defaults)')
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="weight and activation dtype of the plan (default: bfloat16, what accelerators load)")
    p.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a deployment option of the model, priced as the engine would load it (repeatable), e.g. "
                        "text_encoder_offload=cpu: the text encoder in host memory, off every device (default: none)")
    p.add_argument("--cache", action="append", default=[], metavar="METHOD",
                   help="count a cache's memory too (adaln_schedule: the per-step AdaLN tables; default: none)")
    p.add_argument("--all", action="store_true", help="list every placement (default: the fitting ones and the "
                                                      "smallest that does not)")
    p.add_argument("--what-if", action="store_true",
                   help="also list placements this build cannot run (parallel dims the model does not implement), "
                        "marked; never picked by auto (default: hidden)")
    p.add_argument("--json", action="store_true", help="machine-readable output (docs/plan-json.md; every row, "
                                                       "with its runnable flag)")
    return p


def parse_request(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest("request", f"--request must be a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request", f"--request must be a JSON object, got {type(data).__name__}")
    if "extra" in data and not isinstance(data["extra"], dict):
        raise InvalidRequest("request.extra", "must be a JSON object")
    return data


def build_plan(model: str, *, devices: int = 1, device_memory_gib: float = 80.0, request: dict[str, Any] | None = None,
               dtype: str = "bfloat16", caches: tuple[str, ...] = (), host: Any = None, settings: Any = None,
               fast_init: bool = False, cost: Any = None, model_options: dict[str, Any] | None = None,
               platform: str | None = None) -> Any:
    """The :class:`~omnicore.planning.Plan` of ``model`` (Python entry point of ``omnicore plan``).

    ``fast_init`` skips ``torch.nn.init`` while the meta-device modules are built (process-wide for the
    duration: only for a process doing nothing else, as the ``omnicore plan`` command). ``cost``: the
    :class:`~omnicore.planning.estimate.CostModel` (default: an H200-class device with its runtime reserve).
    ``model_options``: the model's deployment options (checked as the engine checks them), e.g.
    ``text_encoder_offload=cpu``; ``platform``: where it runs (``cpu``: the device is host memory, so nothing a
    host option keeps there leaves a rank's bytes; default: an accelerator)."""
    import torch

    from ..config import resolve_settings
    from ..engine.model_options import resolve_model_options
    from ..planning import make_plan, resolve_source
    from ..planning.estimate import host_components
    from ..planning.source import ByteCounter, header_parameters
    from ..plugin_host.host import PluginHost

    if devices < 1:
        raise InvalidRequest("devices", f"must be >= 1, got {devices}")
    if not device_memory_gib > 0:
        raise InvalidRequest("device_memory", f"must be > 0 GiB, got {device_memory_gib}")
    settings = settings or resolve_settings()
    host = host or PluginHost(settings)
    src = resolve_source(model, host, settings)
    given = dict(model_options or {})
    options = resolve_model_options(src.spec, given)  # unknown names / bad values: a ConfigError naming them
    torch_dtype = getattr(torch, dtype)
    counter = ByteCounter()
    declared = header_parameters(src.root, counter)
    from ..planning.meta import skipped_init

    with skipped_init() if fast_init else contextlib.nullcontext():  # meta modules need no initial values
        profile = src.profile.plan_model(src.root, torch_dtype)
        sized = src.profile.plan_request(src.root, dict(request or {}))
        notes: list[str] = []
        if profile.get("provenance"):
            notes += [f"{k}: {v}" for k, v in dict(profile["provenance"]).items()]
        if src.kind == "real":
            notes.append("real: preset: configs only, no weights (built on the meta device)")
        plan = make_plan(model=model, spec=src.spec.name, source=src.kind, profile=profile, request=sized,
                         dtype=torch_dtype, devices=devices, device_memory_bytes=int(device_memory_gib * GIB),
                         caches=tuple(caches), header_bytes_read=counter.read, extra_notes=tuple(notes),
                         parallel_dims=tuple(src.spec.capabilities.parallel), cost=cost,
                         host=host_components(profile, options, platform),
                         model_options={k: options[k] for k in given})
    if declared:
        import attrs

        comps = {k: {**v, "checkpoint_params": declared.get(k, {}).get("params")} for k, v in plan.components.items()}
        plan = attrs.evolve(plan, components=comps)
    return plan


def format_table(plan: Any, show_all: bool = False, what_if: bool = False) -> str:
    lines = [f"plan for {plan.model} ({plan.spec}, {plan.source}; {plan.dtype}; {plan.devices} device(s) x "
             f"{plan.device_memory_bytes / GIB:g} GiB)"]
    req = dict(plan.request)
    lines.append("request: " + ", ".join(f"{k}={v}" for k, v in req.items()))
    lines.append("components (weights):")
    for name, c in plan.components.items():
        lines.append(f"  {name:<16} {c['params']:>16,} params  {c['bytes'] / GIB:8.2f} GiB")
    rows = [p for p in plan.placements if what_if or p.runnable]
    listed = len(rows)
    if not show_all:
        fitting = [p for p in rows if p.fits]
        over = sorted((p for p in rows if not p.fits), key=lambda p: p.per_rank)[:3]
        rows = fitting + [p for p in over if p not in fitting]
    head = (f"  {'placement':<30} {'dev':>3} {'weights':>9} {'caches':>8} {'activ.':>8} {'per rank':>9} "
            f"{'load':>7}  fits  step(s)")
    lines += ["placements (GiB per rank; load = peak while loading, before quantizing/offloading; step = cost-model "
              "estimate):", head]
    for p in rows:
        mark = "  <- auto" if p.auto else ("  (what-if: not runnable here)" if not p.runnable else "")
        load = f"{p.load_peak / GIB:7.2f}" if p.load_peak else f"{'-':>7}"
        lines.append(f"  {p.name:<30} {p.devices:>3} {sum(p.weights.values()) / GIB:9.2f} "
                     f"{sum(p.caches.values()) / GIB:8.2f} {p.activations / GIB:8.2f} {p.per_rank / GIB:9.2f} "
                     f"{load}  {'yes ' if p.fits else 'no  '}  {p.step_seconds:7.3f}{mark}")
    if len(rows) < listed:
        lines.append(f"  ({listed - len(rows)} more with --all)")
    if not what_if and listed < len(plan.placements):
        lines.append(f"  ({len(plan.placements) - listed} what-if rows the model cannot run here: --what-if)")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from ..engine.model_options import parse_option_args

    plan = build_plan(args.model, devices=args.devices, device_memory_gib=args.device_memory,
                      request=parse_request(args.request), dtype=args.dtype, caches=tuple(args.cache),
                      fast_init=True, model_options=parse_option_args(args.model_option or ()))
    if args.json:
        print(json.dumps(plan.to_json(), indent=2, sort_keys=True))
    else:
        sys.stdout.write(format_table(plan, args.all, args.what_if))
    return 0


# ---------------------------------------------------------------------------------------------- --parallel auto
def visible_devices() -> tuple[int, float, str, str]:
    """``(count, GiB each, dtype, platform)`` of this machine's accelerators (CUDA), else one CPU "device" holding
    the memory available now (``/proc/meminfo``'s MemAvailable) and the CPU's float32."""
    import torch

    if torch.cuda.is_available():  # pragma: no cover - no GPU here
        count = torch.cuda.device_count()
        return count, torch.cuda.get_device_properties(0).total_memory / GIB, "bfloat16", "cuda"
    avail = 0.0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return 1, avail or 8.0, "float32", "cpu"


REQUEST_ARGS = ("height", "width", "num_frames", "duration", "num_inference_steps", "guidance_scale", "fps")


def placement_parallel(pick: Any) -> Any:
    """The :class:`~omnicore.parallel.config.ParallelConfig` of a plan row: every degree it uses (cfg, ulysses,
    tp and ep), so the engine loads exactly the placement the plan priced."""
    from ..parallel.config import ParallelConfig

    dims = (("cfg", pick.cfg), ("ulysses", pick.ulysses), ("tp", pick.tp), ("ep", pick.ep))
    return ParallelConfig.parse(",".join(f"{d}={n}" for d, n in dims if n > 1) or None)


def resolve_auto(args: argparse.Namespace, extra: dict[str, Any] | None = None, *,
                 model: str | None = None) -> dict[str, Any]:
    """``--parallel auto``: the Engine keywords of the placement the plan picks for this machine and request
    (``parallel``, and ``offload`` / ``quantization`` when the pick needs them and the user left them unset); a
    request no runnable placement fits is refused here, before loading, naming the estimate and the limit.

    The limit planned with is ``--device-memory`` when given, else the visible device's memory (on a CPU, the
    memory available now); it is handed to the engine as its ``device_memory`` too, so a later request the
    placement cannot hold is refused at admission with the same numbers. Both use the same per-rank reserve
    (:meth:`~omnicore.planning.estimate.CostModel.for_platform`: 1.5 GiB on an accelerator, none on a CPU)."""
    from ..planning.estimate import CostModel

    devices, memory, dtype, platform = visible_devices()
    asked = getattr(args, "device_memory", None)
    if asked is not None and asked > 0:
        memory = float(asked)
    request: dict[str, Any] = {k: getattr(args, k) for k in REQUEST_ARGS if getattr(args, k, None) is not None}
    if extra:
        request["extra"] = dict(extra)
    if getattr(args, "prompt", None):
        request["prompt"] = args.prompt
    model = model or args.model
    if not isinstance(model, str):  # `serve A B --parallel auto` plans each model on its own (cli/serve_pool.py)
        names = list(model or ())
        if len(names) != 1:
            raise InvalidRequest("parallel", f"auto plans one model at a time, got {names}; give each model its "
                                             "own --parallel in models.toml, or serve them one per server")
        model = names[0]
    from ..engine.model_options import parse_option_args

    plan = build_plan(model, devices=devices, device_memory_gib=memory, request=request, dtype=dtype,
                      cost=CostModel.for_platform(platform), fast_init=True, platform=platform,
                      model_options=parse_option_args(getattr(args, "model_option", None) or ()))
    pick = plan.auto
    if pick is None:
        runnable = [p for p in plan.placements if p.runnable]
        best = min(runnable, key=lambda p: p.per_rank) if runnable else None
        need = f"; the smallest ({best.name}) needs {best.per_rank / GIB:.1f} GiB per rank" if best else ""
        raise InvalidRequest("parallel", f"auto: no placement of {model} fits {devices} device(s) of "
                                         f"{memory:.1f} GiB for this request{need} (omnicore plan shows all)")
    out: dict[str, Any] = {"parallel": placement_parallel(pick)}
    if pick.offload != "none" and getattr(args, "offload", "none") in (None, "none"):
        out["offload"] = pick.offload
    if pick.quantization != "none" and getattr(args, "quantization", "none") in (None, "none"):
        out["quantization"] = pick.quantization
    if asked is None:  # the engine refuses later requests over the limit this placement was picked for
        out["device_memory"] = round(memory, 3)
    out["_auto_placement"] = pick.name
    return out
