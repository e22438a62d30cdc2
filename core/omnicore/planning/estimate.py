"""The estimator: weight bytes per rank (exact, from meta-device modules) and activation peaks (estimated).

**Weights.** Each component's bytes are the sum of ``numel * element_size`` over its parameters and buffers as
the plugin's ``plan_model`` built it on the meta device, cast as its loader casts (so a plan and a real load of
the same dtype agree to the byte; a test checks this on every tiny preset). Tensor parallel divides the linears
a DiT's ``tensor_parallel_plan`` names with :func:`omnicore.parallel.tensor_parallel.sharded_parameter_bytes`,
the same rules the loader applies. Weight-only int8 / fp8 replaces each quantizable linear's weight by one byte
per element plus one float32 scale per output channel (torchao's int8 adds a one-byte zero point per channel;
the bias keeps its dtype).

**Activations (estimate).** For a DiT forward over ``S`` rows (per rank) in a ``b``-byte dtype, the peak inside
a block is taken as ``S * b * (10 * H + 2 * max(6 * I, 3 * F))`` with ``H`` the hidden size, ``I`` = heads x
head_dim and ``F`` the FFN width: residual-stream tensors and the per-row modulation vectors (shift, scale, gate
for attention and MLP) take ``10 H``; the wider of attention's q, k, v with their normed/rotated copies and
output, or the MLP's fused gate|up output and activation, counted twice for the temporaries around them. The
constants are calibrated against a measured CPU forward (a LingBot DiT of hidden 1024, 8 blocks, fp32: peak RSS
rise 496 MiB at 4,672 rows, estimate 511 MiB); other models and GPUs are unmeasured. Memory-efficient attention
is assumed (no S x S score matrix). Ulysses
divides ``S`` by its degree; tensor parallel divides ``I`` and ``F``; CFG-parallel runs one branch per rank.
A fixed reserve (``CostModel.runtime_reserve_gib``: CUDA context, allocator slack, workspace) is added to every
rank. Text-encoder and VAE activations are not estimated (the VAE decodes tiled); this is stated in the notes.

**Cost model (``--parallel auto``).** Per denoise step and rank: compute = FLOPs / ``device_tflops`` (linear
FLOPs ``2 * S * layers * (4 * H * I + 3 * H * F)`` plus attention ``4 * S_total * S_rank * I * layers``, both
divided by the parallel degree), plus communication / ``link_gbps`` (Ulysses: four all-to-alls of ``S * I * b``
per layer, each moving ``(k-1)/k`` of the data; TP: two all-reduces of ``S * H * b`` per layer at ``2(k-1)/k``;
CFG: one gather of the output), plus offload traffic / ``host_link_gbps`` (layer-wise: every DiT block each
step; model offload: the DiT once per request, spread over the steps). Quantized weights add a
``dequant_overhead`` factor to compute. The cheapest feasible *runnable* placement (the model implements its
parallel dims) that uses at most ``--devices`` wins; ties go to fewer devices. Quantization combines with every
parallel dim: each rank quantizes what it holds (a tensor-parallel rank its own shard).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import attrs

SCHEMA_VERSION = 1
GIB = 1024 ** 3
QUANTIZATIONS = ("none", "int8", "fp8")


@attrs.frozen
class CostModel:
    """Constants of the stated cost model (defaults: an H200-class device; change them with ``--cost``)."""

    device_tflops: float = 400.0  # sustained bf16 dense TFLOP/s (about 40 % of an H200's peak)
    link_gbps: float = 300.0  # GB/s between devices (NVLink class)
    host_link_gbps: float = 25.0  # GB/s host <-> device (PCIe 5 x16, pinned)
    runtime_reserve_gib: float = 1.5  # per rank: CUDA context, allocator slack, workspace
    dequant_overhead: float = 1.05  # weight-only quantized matmul vs bf16 (unmeasured here)

    def to_json(self) -> dict[str, float]:
        return attrs.asdict(self)

    @classmethod
    def for_platform(cls, platform: str | None) -> CostModel:
        """The defaults for ``platform``: an accelerator (``cuda``, ``npu``) keeps the runtime reserve (its
        context, allocator slack and workspace live in device memory); a CPU "device" is the host memory the
        process already occupies, so no reserve (``--parallel auto`` and the engine's admission agree on this)."""
        return cls() if platform in ("cuda", "npu") else cls(runtime_reserve_gib=0.0)


@attrs.frozen
class Placement:
    """One candidate: how the model is spread, what each rank holds and whether it fits."""

    name: str
    devices: int
    ulysses: int = 1
    tp: int = 1
    cfg: int = 1
    ep: int = 1
    offload: str = "none"
    quantization: str = "none"
    weights: Mapping[str, int] = attrs.field(factory=dict)  # component -> bytes resident per rank (peak phase)
    caches: Mapping[str, int] = attrs.field(factory=dict)
    activations: int = 0
    reserve: int = 0
    host_bytes: int = 0
    load_peak: int = 0  # bytes one rank holds while loading (quantized rows: the unquantized weights + reserve)
    host_weights: Mapping[str, int] = attrs.field(factory=dict)  # components kept in rank 0's host memory
    step_seconds: float = 0.0
    fits: bool = False
    auto: bool = False
    runnable: bool = True  # this build can run it (the model implements every parallel dim of the row)

    @property
    def per_rank(self) -> int:
        return sum(self.weights.values()) + sum(self.caches.values()) + self.activations + self.reserve

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "devices": self.devices, "ulysses": self.ulysses, "tp": self.tp,
                "cfg": self.cfg, "ep": self.ep, "offload": self.offload, "quantization": self.quantization,
                "weights_bytes": dict(self.weights), "cache_bytes": dict(self.caches),
                "activation_bytes": self.activations, "reserve_bytes": self.reserve,
                "per_rank_bytes": self.per_rank, "per_rank_gib": round(self.per_rank / GIB, 3),
                "host_bytes": self.host_bytes, "load_peak_bytes": self.load_peak,
                "host_weights_bytes": dict(self.host_weights),
                "step_seconds_estimate": round(self.step_seconds, 6),
                "fits": self.fits, "runnable": self.runnable, "auto": self.auto}


@attrs.frozen
class Plan:
    """Everything ``omnicore plan`` prints; :meth:`to_json` is the stable schema of ``docs/plan-json.md``."""

    model: str
    spec: str
    source: str
    dtype: str
    devices: int
    device_memory_bytes: int
    request: Mapping[str, Any]
    components: Mapping[str, Mapping[str, Any]]
    placements: tuple[Placement, ...]
    cost_model: CostModel
    notes: tuple[str, ...] = ()
    header_bytes_read: int = 0
    model_options: Mapping[str, Any] = attrs.field(factory=dict)  # the deployment options priced (non-default)

    @property
    def auto(self) -> Placement | None:
        return next((p for p in self.placements if p.auto), None)

    def to_json(self) -> dict[str, Any]:
        auto = self.auto
        return {"schema_version": SCHEMA_VERSION, "model": self.model, "spec": self.spec, "source": self.source,
                "dtype": self.dtype, "devices": self.devices, "device_memory_bytes": self.device_memory_bytes,
                "request": dict(self.request), "components": {k: dict(v) for k, v in self.components.items()},
                "placements": [p.to_json() for p in self.placements], "auto": None if auto is None else auto.name,
                "cost_model": self.cost_model.to_json(), "notes": list(self.notes),
                "header_bytes_read": self.header_bytes_read, "model_options": dict(self.model_options)}


# ---------------------------------------------------------------------------------------------- weights


def tensor_bytes(module: Any) -> int:
    """Bytes of a module's parameters and buffers (meta tensors report their dtype's size)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def quantizable_weights(module: Any, patterns: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The weights weight-only quantization replaces: the ``weight`` of every ``nn.Linear`` whose qualified name
    matches a pattern, and any parameter of two or more dims whose own qualified name matches one (stacked
    expert weights ``[experts, out, in]``)."""
    import torch

    found: list[tuple[str, Any]] = []
    for mod_name, sub in module.named_modules():
        for leaf, p in sub.named_parameters(recurse=False):
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            linear = isinstance(sub, torch.nn.Linear) and leaf == "weight"
            if (linear and any(fnmatch.fnmatchcase(mod_name, pat) for pat in patterns)) or (
                    p.dim() >= 2 and any(fnmatch.fnmatchcase(full, pat) for pat in patterns)):
                found.append((full, p))
    return found


def quantized_saving(module: Any, patterns: tuple[str, ...], degree: int = 1, mode: str = "int8",
                     plan: Any = None) -> tuple[int, int]:
    """``(bytes saved, weights)`` when every quantizable weight becomes 1 byte per element plus its per-row
    overhead (a float32 scale; torchao's int8 adds a zero point: :func:`omnicore.quantization.row_overhead`).
    With a tensor-parallel ``plan`` and ``degree`` > 1, each weight is priced as one rank's shard under it (the
    shard each rank quantizes): a column split divides the rows and their scales, a row split only the columns
    (every rank keeps a scale per output row); without a plan, ``degree`` divides the saving (an approximation)."""
    import math

    import torch

    from ..quantization import row_overhead

    saved = 0
    weights = quantizable_weights(module, patterns)
    linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)}
    for full, w in weights:
        extra = row_overhead(mode, stacked=id(w) not in linear_weights)
        if plan is not None and degree > 1:
            shape = list(w.shape)
            mod_name, _, leaf = full.rpartition(".")
            split = plan.param_split(mod_name, leaf)
            if split is not None:
                shape[split[0]] //= degree
            numel = math.prod(shape)
            saved += numel * w.element_size() - (numel + extra * (numel // shape[-1]))
            continue
        rows = w.numel() // w.shape[-1]
        saved += (w.numel() * w.element_size() - (w.numel() + extra * rows)) // degree
    return saved, len(weights)


def tp_dit_bytes(dit: Any, plan: Any, degree: int) -> int | None:
    """The DiT's bytes per TP rank under the plan its model declares (the same :class:`TensorParallelPlan` its
    loader shards with); ``None`` without a plan or for a degree the plan refuses."""
    if plan is None:
        return None
    try:
        from ..parallel.tensor_parallel import sharded_parameter_bytes
    except ImportError:  # pragma: no cover - a core without tensor parallelism
        return None
    try:
        plan.check(degree)
    except Exception:
        return None
    buffers = sum(b.numel() * b.element_size() for b in dit.buffers())
    return int(sharded_parameter_bytes(dit, plan, degree)) + buffers


def _refusal(plan: Any, degree: int) -> str:
    """Why ``plan`` refuses ``degree`` (its ConfigError's message)."""
    try:
        plan.check(degree)
    except Exception as exc:  # noqa: BLE001 - any refusal is reported as a note, never raised
        return str(exc)
    return "refused"


def block_bytes(dit: Any, prefix: str) -> tuple[int, int]:
    """``(largest block, everything outside the blocks)`` of a DiT whose blocks live under ``prefix``."""
    blocks: dict[str, int] = {}
    outside = 0
    for name, t in [*dit.named_parameters(), *dit.named_buffers()]:
        size = t.numel() * t.element_size()
        if name.startswith(prefix):
            key = name[len(prefix):].split(".", 1)[0]
            blocks[key] = blocks.get(key, 0) + size
        else:
            outside += size
    return (max(blocks.values()) if blocks else 0), outside


# ---------------------------------------------------------------------------------------------- activations


def activation_bytes(shape: Mapping[str, int], rows: int, dtype_bytes: int, tp: int = 1) -> int:
    """The estimated peak of one DiT block over ``rows`` rows on one rank (see the module docstring)."""
    hidden, inner, ffn = shape["hidden"], shape["heads"] * shape["head_dim"], shape["ffn"]
    return int(rows * dtype_bytes * (10 * hidden + 2 * max(6 * inner, 3 * ffn) / tp))


def step_seconds(shape: Mapping[str, int], rows: int, branches: int, cost: CostModel, *, ulysses: int, tp: int,
                 cfg: int, dtype_bytes: int, host_traffic: int = 0, quantized: bool = False, ep: int = 1) -> float:
    """The cost model's seconds per denoise step on one rank (expert parallelism divides only the MLP's work:
    its tokens are replicated)."""
    layers, hidden = shape["layers"], shape["hidden"]
    inner, ffn = shape["heads"] * shape["head_dim"], shape["ffn"]
    total_rows = rows * branches
    attn_linear = 2 * total_rows * layers * 4 * hidden * inner
    mlp = 2 * total_rows * layers * 3 * hidden * ffn
    attention = 4 * branches * rows * rows * inner * layers
    degree = ulysses * tp * cfg
    compute = (attn_linear + attention + mlp / ep) / degree / (cost.device_tflops * 1e12)
    if quantized:
        compute *= cost.dequant_overhead
    rank_rows = total_rows / cfg / ulysses
    comm = 0.0
    if ulysses > 1:
        comm += 4 * layers * rank_rows * inner / tp * dtype_bytes * (ulysses - 1) / ulysses
    if tp > 1:
        comm += 2 * layers * rank_rows * hidden * dtype_bytes * 2 * (tp - 1) / tp
    if ep > 1:  # one all-reduce of the MoE output per layer
        comm += layers * rank_rows * hidden * dtype_bytes * 2 * (ep - 1) / ep
    if cfg > 1:
        comm += rows * hidden * dtype_bytes
    return compute + comm / (cost.link_gbps * 1e9) + host_traffic / (cost.host_link_gbps * 1e9)


def rank_rows(rows: int, branches: int, *, cfg: int = 1, ulysses: int = 1) -> int:
    """DiT rows one rank computes per forward: both guidance branches batched unless CFG-parallel splits them,
    then a Ulysses share (rounded up)."""
    per_rank_branches = branches // cfg if branches % cfg == 0 else branches
    return -(-rows * per_rank_branches // ulysses)


def request_cache_bytes(request: Mapping[str, Any], shape: Mapping[str, Any], dtype_bytes: int,
                        caches: tuple[str, ...] = ()) -> dict[str, int]:
    """Cache bytes a request adds (``plan_request``'s ``cache_elements``; the AdaLN schedule's tables when that
    cache is enabled)."""
    out: dict[str, int] = {}
    steps = int(request.get("steps", 1))
    if "adaln_schedule" in caches and request.get("adaln_rows_per_step"):
        # one [steps, rows, 6H] table per block, in the DiT dtype (the AdaLN schedule cache)
        out["adaln_tables"] = (shape["layers"] * steps * int(request["adaln_rows_per_step"])
                               * 6 * shape["hidden"] * dtype_bytes)
    for name, elements in dict(request.get("cache_elements") or {}).items():  # e.g. a prompt K/V cache
        out[name] = int(elements) * dtype_bytes
    return out


def expert_saving(module: Any, patterns: tuple[str, ...], degree: int, *, quant: str = "none",
                  quantizable: tuple[str, ...] = ()) -> int:
    """Bytes one expert-parallel rank does not hold: ``(degree - 1) / degree`` of every parameter of the
    modules ``patterns`` name (stacked experts ``[E, ...]``, split on the expert dim), priced quantized when
    ``quant`` is set and ``quantizable`` names them."""
    from ..quantization import row_overhead

    quantized = {id(p) for _, p in quantizable_weights(module, quantizable)} if quant != "none" else set()
    saved = 0
    for name, sub in module.named_modules():
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            for p in sub.parameters(recurse=False):
                if id(p) in quantized:
                    size = p.numel() + row_overhead(quant, stacked=True) * (p.numel() // p.shape[-1])
                else:
                    size = p.numel() * p.element_size()
                saved += size - size // degree
    return saved


#: parallel dims this build runs with weight-only quantization: each rank quantizes what it holds after the load
#: (replicated or expert-partitioned weights; a tensor-parallel shard through omnicore.parallel.local_linear)
QUANTIZED_DIMS = ("cfg", "ulysses", "tp", "ep")


# ---------------------------------------------------------------------------------------------- the plan


def host_components(profile: Mapping[str, Any], model_options: Mapping[str, Any] | None,
                    platform: str | None = None) -> tuple[str, ...]:
    """Components a deployment option keeps in host memory instead of on the device: the profile's
    ``text_encoder`` under ``text_encoder_offload=cpu`` (:mod:`omnicore.parallel.host_text_encoder`). On a CPU
    platform the device *is* host memory, so nothing leaves it (rank 0 still holds the encoder)."""
    from ..parallel.host_text_encoder import text_encoder_on_host

    if platform == "cpu" or not text_encoder_on_host(model_options) or not profile.get("text_encoder"):
        return ()
    return (str(profile["text_encoder"]),)


def _divisors_up_to(n: int, limit: int) -> list[int]:
    return [d for d in range(2, limit + 1) if n % d == 0]


def placement_name(*, cfg: int = 1, ulysses: int = 1, ep: int = 1, tp: int = 1, quant: str = "none") -> str:
    """``cfg=2,tp=2,ulysses=2+int8``-style row names (``single`` without parallelism)."""
    parts = [f"{d}={n}" for d, n in (("cfg", cfg), ("tp", tp), ("ep", ep), ("ulysses", ulysses)) if n > 1]
    return (",".join(parts) or "single") + ("" if quant == "none" else f"+{quant}")


def make_plan(*, model: str, spec: str, source: str, profile: Mapping[str, Any], request: Mapping[str, Any],
              dtype: Any, devices: int, device_memory_bytes: int, cost: CostModel | None = None,
              caches: tuple[str, ...] = (), header_bytes_read: int = 0, extra_notes: tuple[str, ...] = (),
              parallel_dims: tuple[str, ...] = ("cfg", "ulysses", "tp"),
              quantizations: tuple[str, ...] = QUANTIZATIONS,
              quantized_dims: tuple[str, ...] = QUANTIZED_DIMS, host: tuple[str, ...] = (),
              model_options: Mapping[str, Any] | None = None) -> Plan:
    """Price every candidate placement of ``profile`` (``plan_model``'s dict) for ``request`` (``plan_request``'s)
    on ``devices`` devices of ``device_memory_bytes`` each (``quantizations``: the modes priced). ``host``: the
    components kept whole and unquantized in rank 0's host memory (:func:`host_components`): they leave every
    rank's device bytes, its load peak included, and are listed as ``host_weights``."""
    import torch

    cost = cost or CostModel()
    dtype_bytes = torch.empty((), dtype=dtype, device="meta").element_size()
    comps: Mapping[str, Any] = profile["components"]
    dit_name: str = profile["dit"]
    dit = comps[dit_name]
    shape: Mapping[str, Any] = profile["shape"]
    quantizable: Mapping[str, tuple[str, ...]] = profile.get("quantizable") or {}
    notes = list(extra_notes)
    offloadable: list[str] = list(profile.get("offload_modules") or [dit_name])
    offload_modes: list[str] = list(profile.get("offload_modes", ("model", "layerwise")))
    if len(offload_modes) < 2:
        notes.append(f"offload: {dit_name} serves only {offload_modes or 'no'} offload mode(s)")

    weights = {name: tensor_bytes(m) for name, m in comps.items()}
    components = {name: {"params": sum(p.numel() for p in m.parameters()), "bytes": weights[name],
                         "quantizable_weights": len(quantizable_weights(m, tuple(quantizable.get(name, ()))))}
                  for name, m in comps.items()}
    savings = {q: {name: quantized_saving(m, tuple(quantizable.get(name, ())), mode=q)[0]
                   for name, m in comps.items()} for q in quantizations if q != "none"}
    rows = int(request["tokens"])
    branches = int(request.get("cfg_branches", 1))
    steps = int(request.get("steps", 1))
    cache_bytes = request_cache_bytes(request, shape, dtype_bytes, caches)
    biggest_block, outside_blocks = block_bytes(dit, str(shape.get("block_prefix", "blocks.")))
    reserve = int(cost.runtime_reserve_gib * GIB)
    host_total = sum(weights.values())
    candidates: list[Placement] = []
    shard_fn = profile.get("shard")  # (tp, ep) -> rank 0's narrowed meta components, by the loader's own code
    experts: Mapping[str, Any] = profile.get("experts") or {}
    tp_plans: Mapping[str, Any] = profile.get("tp_plans") or {}  # component -> the plan its loader shards with
    tp_plan = tp_plans.get(dit_name)
    narrowed: dict[tuple[int, int], dict[str, Any] | None] = {}
    priced: dict[tuple[int, int, str], dict[str, int] | None] = {}
    refusals: dict[tuple[int, int], str] = {}  # the model's reason for each (tp, ep) its shard hook refused

    def narrowed_modules(tp: int, ep: int) -> dict[str, Any] | None:
        if (tp, ep) not in narrowed:
            from ..errors import ConfigError

            assert shard_fn is not None
            try:
                narrowed[(tp, ep)] = dict(shard_fn(tp, ep))
            except (ConfigError, ValueError) as exc:  # a degree the model refuses (heads, experts it does not divide)
                narrowed[(tp, ep)] = None
                refusals[(tp, ep)] = str(exc)
        return narrowed[(tp, ep)]

    def sharded(tp: int, ep: int, quant: str) -> dict[str, int] | None:
        """Rank 0's bytes of the components ``(tp, ep)`` narrows (quantized as ``quant``), or None (refused)."""
        if shard_fn is not None:
            if (tp, ep, quant) not in priced:  # each row of a (tp, ep, quant) prices the same modules
                mods = narrowed_modules(tp, ep)
                priced[(tp, ep, quant)] = None if mods is None else {
                    k: tensor_bytes(m) - (quantized_saving(m, tuple(quantizable.get(k, ())), mode=quant)[0]
                                          if quant != "none" else 0) for k, m in mods.items()}
            found = priced[(tp, ep, quant)]
            return None if found is None else dict(found)
        out: dict[str, int] = {}
        if tp > 1:
            if tp_plan is None:
                return None
            for name, plan in tp_plans.items():  # the DiT(s) and any other component the model splits (text encoder)
                if name not in comps or name in host:  # a host-resident component is never split
                    continue
                shard = tp_dit_bytes(comps[name], plan, tp)
                if shard is None:
                    refusals.setdefault((tp, ep), f"{name}: {_refusal(plan, tp)}")
                    return None
                saved = (quantized_saving(comps[name], tuple(quantizable.get(name, ())), tp, mode=quant,
                                          plan=plan)[0] if quant != "none" else 0)
                out[name] = shard - saved
        if ep > 1:
            count = int(experts.get("count", 0))
            if not count or count % ep:
                return None
            for name, patterns in dict(experts.get("modules") or {}).items():
                base = out.get(name, weights[name] - (savings[quant][name] if quant != "none" else 0))
                saved = expert_saving(comps[name], tuple(patterns), ep, quant=quant,
                                      quantizable=tuple(quantizable.get(name, ())))
                out[name] = base - saved // tp  # a TP rank's experts are already 1/tp of each

        return out

    def add(*, ulysses: int = 1, tp: int = 1, cfg: int = 1, ep: int = 1, offload: str = "none",
            quant: str = "none") -> None:
        per = dict(weights)
        if quant != "none":
            per = {k: v - savings[quant][k] for k, v in per.items()}
        if tp > 1 or ep > 1:
            narrowed_bytes = sharded(tp, ep, quant)
            if narrowed_bytes is None:
                return
            per.update(narrowed_bytes)
        on_host = {k: weights[k] for k in host if k in per}  # whole and unquantized, in rank 0's host memory
        per = {k: v for k, v in per.items() if k not in on_host}
        resident = dict(per)
        host_traffic = 0
        if offload == "model":  # the declared offload modules visit the device one at a time; the rest stay
            moving = [k for k in offloadable if k in per]
            resident = {k: v for k, v in per.items() if k not in moving}
            if moving:
                largest = max(moving, key=lambda k: per[k])
                resident[largest] = per[largest]
            host_traffic = per[dit_name] // max(steps, 1)
        elif offload == "layerwise":  # DiT blocks stream through (two in flight); everything else stays
            scale = per[dit_name] / max(weights[dit_name], 1)
            resident = {k: v for k, v in per.items() if k != dit_name}
            resident[dit_name] = int((outside_blocks + 2 * biggest_block) * scale)
            host_traffic = per[dit_name]
        act = activation_bytes(shape, rank_rows(rows, branches, cfg=cfg, ulysses=ulysses), dtype_bytes, tp)
        secs = step_seconds(shape, rows, branches, cost, ulysses=ulysses, tp=tp, cfg=cfg, dtype_bytes=dtype_bytes,
                            host_traffic=host_traffic, quantized=quant != "none", ep=ep)
        dims = [d for d, n in (("cfg", cfg), ("ulysses", ulysses), ("tp", tp), ("ep", ep)) if n > 1]
        runnable = all(d in parallel_dims for d in dims) and (
            quant == "none" or all(d in quantized_dims for d in dims))
        # the loaders place every component on the device, and the engine quantizes and offloads after the whole
        # load (each rank its share): until then a rank holds its unquantized weights on the device
        load_peak = 0
        if quant != "none" or offload != "none":
            plain = dict(weights)
            if tp > 1 or ep > 1:
                plain.update(sharded(tp, ep, "none") or {})
            load_peak = sum(v for k, v in plain.items() if k not in on_host) + reserve
        p = Placement(name=placement_name(cfg=cfg, ulysses=ulysses, ep=ep, tp=tp, quant=quant) if (
                          offload == "none") else f"offload={offload}" + ("" if quant == "none" else f"+{quant}"),
                      devices=ulysses * tp * cfg * ep, ulysses=ulysses, tp=tp, cfg=cfg, ep=ep, offload=offload,
                      quantization=quant, weights=resident, caches=dict(cache_bytes), activations=act,
                      reserve=reserve, host_bytes=host_total if offload != "none" else sum(on_host.values()),
                      load_peak=load_peak, host_weights=on_host, step_seconds=secs, runnable=runnable)
        candidates.append(attrs.evolve(p, fits=max(p.per_rank, p.load_peak) <= device_memory_bytes))

    heads = int(shape["heads"])
    cfg_options = [1, 2] if profile.get("cfg_capable") and branches == 2 and devices >= 2 else [1]
    tp_ok = [d for d in _divisors_up_to(heads, devices) if sharded(d, 1, "none") is not None]
    if not tp_ok and devices > 1:
        refused = next((why for (t, _), why in refusals.items() if t > 1), None)
        notes.append(f"tp: left out ({dit_name} declares no tensor-parallel plan)" if tp_plan is None and
                     shard_fn is None else f"tp: left out ({refused})" if refused else
                     f"tp: no degree up to {devices} divides the plan's counts")
    count = int(experts.get("count", 0))
    ep_ok = _divisors_up_to(count, devices) if count else []
    wanted = {"ulysses", "tp", *(["ep"] if ep_ok else []), *(["cfg"] if len(cfg_options) > 1 else [])}
    missing = sorted(wanted - set(parallel_dims))
    if devices > 1 and len(cfg_options) == 1:
        notes.append(f"cfg: no rows ({spec} is guidance-distilled: one DiT forward per step)" if not
                     profile.get("cfg_capable") else "cfg: no rows (this request runs one guidance branch)")
    if devices > 1 and missing:
        notes.append(f"{', '.join(missing)}: not implemented by {spec} here; such rows are what-if estimates "
                     "(runnable: false; shown with --what-if), never picked by auto")
    unquantized = [d for d in ("cfg", "ulysses", "tp", "ep") if d not in quantized_dims]
    if devices > 1 and any(q != "none" for q in quantizations) and unquantized:
        notes.append(f"quantization runs with {', '.join(quantized_dims)} here; quantized "
                     f"{', '.join(unquantized)} rows are what-if")
    for quant in quantizations:
        add(quant=quant)
        for mode in offload_modes:
            add(offload=mode, quant=quant)
        for cfg in cfg_options:
            for ul in [1, *_divisors_up_to(heads, devices // cfg)]:
                for tp in [1, *tp_ok]:
                    for ep in [1, *ep_ok]:
                        if (cfg, ul, tp, ep) == (1, 1, 1, 1) or cfg * ul * tp * ep > devices or heads % (ul * tp):
                            continue
                        add(ulysses=ul, tp=tp, cfg=cfg, ep=ep, quant=quant)
    feasible = [p for p in candidates if p.fits and p.runnable and p.devices <= devices]
    if feasible:
        best = min(feasible, key=lambda p: (round(p.step_seconds, 9), p.devices, p.per_rank))
        candidates = [attrs.evolve(p, auto=True) if p is best else p for p in candidates]
    else:
        notes.append("no placement fits: more devices, more memory per device, or a smaller request")
    if any(p.load_peak for p in candidates):
        notes.append("quantization and offload apply after the load: a rank first holds its unquantized weights on "
                     "the device, so a +int8/+fp8 or offload row fits only if that load peak does too "
                     "(load_peak_bytes in --json)")
    for name in host:
        if name in weights:
            notes.append(f"text_encoder_offload=cpu: {name} ({weights[name] / GIB:.2f} GiB, whole and unquantized) "
                         "stays in rank 0's host memory and encodes on its CPU; no device holds it, its rows are "
                         "broadcast to the other ranks (host_weights_bytes in --json)")
    notes.append("weights: exact bytes of the meta-built modules; activations: estimated (formula in docs/"
                 "plan-json.md), text-encoder and VAE activations not included")
    return Plan(model=model, spec=spec, source=source, dtype=str(dtype).replace("torch.", ""), devices=devices,
                device_memory_bytes=device_memory_bytes, request=dict(request.get("resolved") or {}) | {
                    "tokens": rows, "cfg_branches": branches, "steps": steps},
                components=components, placements=tuple(candidates), cost_model=cost, notes=tuple(notes),
                header_bytes_read=header_bytes_read, model_options=dict(model_options or {}))
