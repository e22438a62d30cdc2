"""Per-request adapters on a loaded model, without merging: :class:`LoRARuntime`.

The runtime puts a forward hook on every adaptable ``nn.Linear`` of the model (the first time a batch brings an
adapter; the base weights are never touched). Before each forward the engine tells it the batch's requests
(:meth:`LoRARuntime.activate`); each hooked linear then adds, per row, the delta of that row's adapter set through
the platform op ``lora_segment_delta`` — one grouped call per linear for the whole mixed batch. Rows whose request
has no adapter add nothing, and with no adapter in the batch the hooks return at once (bit-identical outputs).

Several adapters on one request are one slot with their ranks concatenated (``[A1; A2]``, ``[s1 B1 | s2 B2]``),
which is exactly the sum of their deltas; scales are folded into ``B``; an adapter with scale 0 is dropped.

Over a worker group (``--parallel``) every rank runs a runtime and activates the adapter versions rank 0 resolved
(:meth:`LoRARuntime.refs`, announced with the batch). Under tensor parallelism each rank's device copies hold its
share (:attr:`~.targets.TargetMap.shards`) and the hooks, prepended to DTensor's own, add the delta to the
linear's local output: a column-parallel linear's output columns; a row-parallel linear's partial sum, or — when the
linear already summed its output over the ranks (a bias) — the whole delta after summing the rank-sized ``x A^T``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import LoRAError
from .records import LoRA
from .registry import AdapterRef, AdapterRegistry, DeviceAdapter
from .rows import current_off, current_packed, current_samples
from .targets import TargetMap, resolve_roots

if TYPE_CHECKING:
    import torch

    from ..engine.request import GenerationRequest
    from ..specs import ModelSpec

logger = logging.getLogger("omnicore.lora")

#: one adapter set: ((device adapter, request scale), ...); the empty set is "no adapter"
AdapterSet = tuple[tuple[DeviceAdapter, float], ...]

_MISSING = object()


def active_loras(request: GenerationRequest) -> tuple[LoRA, ...]:
    """The request's adapters that change anything (scale 0 is exactly no adapter)."""
    return tuple(lora for lora in request.loras if lora.scale != 0.0)


class ActiveBatch:
    """The adapter sets of one batch's outputs and the stacked slots each linear needs (built once per batch).

    A linear's slots are stacked straight from the adapters' device copies, one ``[R, in]`` / ``[out, R]`` pair
    per row segment (ranks of a set concatenated, scales folded into ``B``, smaller ranks zero-padded): these are
    the batch's only device bytes beyond the adapters' own copies (:attr:`nbytes`, reported through
    ``on_bytes`` so the registry's budget counts them)."""

    def __init__(self, output_sets: Sequence[int], sets: Sequence[AdapterSet], ops: Any,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.output_sets = tuple(output_sets)  # output i -> index into sets (0 = none)
        self.sets = tuple(sets)
        self.ops = ops
        self.on_bytes = on_bytes
        self.nbytes = 0
        self._touch: dict[str, tuple[bool, ...]] = {}  # module -> which sets adapt it
        self._stacked: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self._eyes: dict[tuple[Any, ...], Any] = {}
        self._plans: dict[tuple[Any, ...], Any] = {}  # see delta()
        # (which sets adapt the module, input shape, row scopes) -> (seg ends, set ids, host seg_ends tensor):
        # every linear of a forward with the same answer shares one computation
        self._segments: dict[tuple[Any, ...], tuple[list[int], list[int], Any]] = {}

    @property
    def signature(self) -> tuple[Any, ...]:
        return (self.output_sets, tuple(tuple((a.key, s) for a, s in group) for group in self.sets))

    def _touches(self, name: str) -> tuple[bool, ...]:
        found = self._touch.get(name)
        if found is None:
            found = tuple(bool(s) and any(name in ad.modules for ad, _ in group) for s, group in enumerate(self.sets))
            self._touch[name] = found
        return found

    def touches(self, name: str) -> bool:
        return any(self._touches(name))

    def segments(self, name: str, x: torch.Tensor) -> tuple[list[int], list[int]]:
        """``(seg_ends, set ids)`` over the rows of ``x`` (equal neighbouring sets merged)."""
        fan_in = x.shape[-1]
        rows = x.numel() // fan_in if fan_in else 0
        packed = current_packed()
        bounds: list[tuple[int, int]] = []  # (row end, forward sample or -1 for padding)
        if packed is not None and x.dim() == 2 and rows == packed.local_rows:
            lo = packed.start  # a sequence-parallel shard sees rows [lo, lo + rows) of the packed sequence
            bounds = [(min(max(end - lo, 0), rows), j) for j, end in enumerate(packed.ends)]
            if not packed.ends or packed.ends[-1] - lo < rows:
                bounds.append((rows, -1))
            samples = len(packed.ends)
        else:
            # the leading dim is the sample; inside a sample_rows scope the rows split evenly over its samples
            # (a [b, L, H] input flattened to [b * L, H] keeps each sample's rows together)
            declared = current_samples()
            samples = len(declared) if declared is not None and declared else x.shape[0] if x.dim() >= 2 else 0
            if samples == 0 or rows % samples:
                raise RuntimeError(f"LoRA on {name}: cannot tell the samples of an input of shape {tuple(x.shape)}")
            per = rows // samples
            bounds = [((j + 1) * per, j) for j in range(samples)]
        chosen = current_samples()
        n = len(self.output_sets)
        if chosen is not None:
            if len(chosen) != samples:
                raise RuntimeError(f"LoRA on {name}: the pipeline declared {len(chosen)} samples for this forward, "
                                   f"the input {tuple(x.shape)} holds {samples}")
            outputs = [chosen[j] for j in range(samples)]
        elif samples % n == 0:
            outputs = [j % n for j in range(samples)]
        else:
            raise RuntimeError(f"LoRA on {name}: the input {tuple(x.shape)} holds {samples} samples, not a multiple "
                               f"of the batch's {n} outputs; a packed model declares its rows with packed_rows(), a "
                               "pipeline running a subset of its batch with sample_rows()")
        touched = self._touches(name)
        ends: list[int] = []
        ids: list[int] = []
        for end, j in bounds:
            set_id = self.output_sets[outputs[j]] if j >= 0 else 0
            if not touched[set_id]:
                set_id = 0
            if ids and ids[-1] == set_id:
                ends[-1] = end
            elif end > (ends[-1] if ends else 0):
                ends.append(end)
                ids.append(set_id)
        return ends, ids

    def _stack(self, name: str, ids: tuple[int, ...], x: torch.Tensor) -> tuple[Any, Any]:
        """``(a [S, R, in], b [S, out, R])`` of module ``name`` for segments of sets ``ids``."""
        key = (name, ids, x.device, x.dtype)
        stacked = self._stacked.get(key)
        if stacked is not None:
            return stacked
        parts = [[(ad.modules[name], scale) for ad, scale in self.sets[i] if name in ad.modules] for i in ids]
        rank = max(sum(ab[0].shape[0] for ab, _ in group) for group in parts)
        (a0, b0), _ = next(group[0] for group in parts if group)
        a = a0.new_zeros((len(ids), rank, a0.shape[1]))
        b = b0.new_zeros((len(ids), b0.shape[0], rank))
        for k, group in enumerate(parts):
            offset = 0
            for (a_i, b_i), scale in group:  # ranks concatenated: [A1; A2], [s1 B1 | s2 B2] (the sum of deltas)
                r = a_i.shape[0]
                a[k, offset:offset + r] = a_i
                b[k, :, offset:offset + r] = b_i * scale
                offset += r
        stacked = (a.to(device=x.device), b.to(device=x.device))
        self._stacked[key] = stacked
        self.nbytes += sum(t.numel() * t.element_size() for t in stacked)
        if self.on_bytes is not None:
            self.on_bytes(self.nbytes)
        return stacked

    def _plan(self, name: str, x: torch.Tensor) -> tuple[Any, Any, Any] | None:
        """``(a, b, seg_ends)`` of module ``name`` for an input like ``x`` in the current row scopes, or None when
        no row of it is adapted."""
        touched = self._touches(name)
        if not any(touched):
            return None
        import torch

        seg_key = (touched, tuple(x.shape), current_packed(), current_samples())
        found = self._segments.get(seg_key)
        if found is None:
            ends, ids = self.segments(name, x)
            found = (ends, ids, torch.tensor(ends, dtype=torch.int64))
            self._segments[seg_key] = found
        _, ids, seg_ends = found
        if not any(ids):
            return None
        a, b = self._stack(name, tuple(ids), x)
        return a, b, seg_ends

    def _eye(self, segments: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        key = (segments, rank, like.device, like.dtype)
        eye = self._eyes.get(key)
        if eye is None:
            import torch

            eye = torch.eye(rank, device=like.device, dtype=like.dtype).expand(segments, rank, rank).contiguous()
            self._eyes[key] = eye
        return eye

    def delta(self, name: str, x: torch.Tensor,
              reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """The ``[..., out]`` delta of module ``name`` on input ``x``, or None when no row of it is adapted.

        ``reduce`` (a row-parallel linear whose output is already summed over the tensor-parallel ranks) sums the
        rank-sized ``x A^T`` over those ranks in place before ``B`` applies, so every rank adds the whole delta."""
        if current_off():
            return None
        # one look-up per call on the hot path: (module, input shape, row scopes) -> the slots and row segments
        plan_key = (name, x.shape, current_packed(), current_samples(), x.dtype)
        plan = self._plans.get(plan_key, _MISSING)
        if plan is _MISSING:
            plan = self._plan(name, x)
            self._plans[plan_key] = plan
        if plan is None:
            return None
        a, b, seg_ends = plan
        rows = x.reshape(-1, x.shape[-1])
        if reduce is None:
            out = self.ops.lora_segment_delta(rows, a, b, seg_ends)
        else:
            eye = self._eye(a.shape[0], a.shape[1], a)
            shrunk = self.ops.lora_segment_delta(rows, a, eye, seg_ends)  # [N, R]: this rank's share of x A^T
            reduce(shrunk)
            out = self.ops.lora_segment_delta(shrunk, eye, b, seg_ends)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class LoRARuntime:
    """The adapters of one loaded model: admission checks, hooks, and the active batch.

    :param registry: where adapters are resolved and cached.
    :param spec: the model's spec (its ``lora`` field names the adaptable modules).
    :param pipeline: the loaded pipeline (``spec.lora.root`` is read on it).
    :param ops: the platform's op table (``lora_segment_delta``).
    """

    def __init__(self, registry: AdapterRegistry, spec: ModelSpec, pipeline: Any, ops: Any) -> None:
        if spec.lora is None:
            raise ValueError(f"model {spec.name!r} declares no LoRA targets")
        self.registry = registry
        self.spec = spec
        self.roots = resolve_roots(pipeline, spec.lora)
        self.root = self.roots[0]
        self.target_map = TargetMap.build(self.root, spec.lora, spec.name)
        for other in self.roots[1:]:  # one adapter fits every network of the pipeline, or the spec is wrong
            if TargetMap.build(other, spec.lora, spec.name).shapes != self.target_map.shapes:
                raise ValueError(f"model {spec.name!r}: the networks at {spec.lora.root!r} differ in their "
                                 "adaptable linears; one LoRA target map cannot fit them all")
        self.ops = ops
        self.refusal: str | None = None  # set by the engine when a deployment setting rules LoRA out
        self.adaln_cache = False  # the adaln_schedule cache is on: adapters on AdaLN projections are refused
        self._hooks: list[Any] = []
        self._active: ActiveBatch | None = None
        self._active_for: tuple[Any, ...] | None = None  # the requests self._active was built for

    # ------------------------------------------------------------------ admission
    def check(self, loras: Sequence[LoRA]) -> None:
        """Refuse a request's adapters before it is queued (:class:`LoRAError` naming the adapter and the key)."""
        for lora in loras:
            if self.refusal is not None:
                raise LoRAError(lora.name_or_path, None, self.refusal)
            weights = self.registry.host_adapter(lora, self.target_map)
            if self.adaln_cache and lora.scale != 0.0:
                hit = sorted(set(weights.modules) & self.target_map.adaln)
                if hit:
                    raise LoRAError(lora.name_or_path, hit[0], "adapts an AdaLN projection, which the adaln_schedule "
                                                               "cache precomputes from timesteps only; run without "
                                                               "that cache or without this adapter")

    # ------------------------------------------------------------------ execution
    def refs(self, requests: Sequence[GenerationRequest]) -> list[tuple[AdapterRef, ...]]:
        """Each request's adapters resolved and read now (the versions the batch runs with, on every rank)."""
        return [tuple(self.registry.ref(lora, self.target_map) for lora in active_loras(r)) for r in requests]

    def activate(self, requests: Sequence[GenerationRequest],
                 refs: Sequence[tuple[AdapterRef, ...]] | None = None) -> None:
        """Make the hooked linears use these requests' adapters (in batch order, ``num_outputs`` rows each):
        the versions ``refs`` names (rank 0's :meth:`refs`, announced to the worker ranks), or resolved now."""
        if refs is None:
            if not any(active_loras(r) for r in requests):
                self.deactivate()
                return
            refs = self.refs(requests)
        if len(refs) != len(requests):
            raise ValueError(f"{len(refs)} adapter lists for {len(requests)} requests")
        if not any(refs):
            self.deactivate()
            return
        # the same requests as the last call (the next step of a batch): the same adapters, not looked up again,
        # so a batch keeps the adapter versions it started with even if a file changes on disk meanwhile
        ident = tuple((r.request_id, group, r.params.num_outputs) for r, group in zip(requests, refs))
        if self._active is not None and self._active_for == ident:
            return
        self._install()
        param = next(iter(self.root.parameters()), None)
        device = param.device if param is not None else "cpu"
        dtype = param.dtype if param is not None and param.is_floating_point() else None
        sets: list[AdapterSet] = [()]
        index: dict[tuple[Any, ...], int] = {(): 0}
        output_sets: list[int] = []
        keep: list[tuple[Any, ...]] = []
        for request, group_refs in zip(requests, refs):
            group = []
            for ref in group_refs:
                adapter = self.registry.device_adapter(ref, self.target_map, device, self._dtype(dtype), keep)
                keep.append(adapter.key)
                group.append((adapter, ref.scale))
            set_key = tuple((a.key, s) for a, s in group)
            if set_key not in index:
                index[set_key] = len(sets)
                sets.append(tuple(group))
            output_sets.extend([index[set_key]] * request.params.num_outputs)
        batch = ActiveBatch(output_sets, sets, self.ops,
                            on_bytes=lambda nbytes: self.registry.reserve_batch(nbytes, keep))
        if self._active is None or self._active.signature != batch.signature:
            self._active = batch
        self._active_for = ident

    def _dtype(self, dtype: Any) -> Any:
        import torch

        return dtype if dtype is not None else torch.float32

    def deactivate(self) -> None:
        if self._active is not None and self._active.nbytes:
            self.registry.reserve_batch(0, ())
        self._active, self._active_for = None, None

    @property
    def active(self) -> ActiveBatch | None:
        return self._active

    def _install(self) -> None:
        if self._hooks:
            return
        for root in self.roots:
            modules = dict(root.named_modules())
            for name in self.target_map.shapes:
                # first: under tensor parallelism the delta joins the linear's local (DTensor) output before
                # DTensor's own output hook makes it a plain tensor
                self._hooks.append(modules[name].register_forward_hook(self._hook(name), prepend=True))
        logger.info("LoRA hooks on %d linears of %s", len(self._hooks), self.spec.name)

    def _hook(self, name: str) -> Any:
        sharded = self.target_map.shards.get(name, ("", ()))[0]

        def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
            active = self._active
            if active is None or not args:
                return None
            if sharded:
                return _sharded_output(active, name, sharded, args[0], output)
            delta = active.delta(name, args[0])
            if delta is None:
                return None
            if delta.dtype == output.dtype and not output.requires_grad:
                output.add_(delta)  # the linear's fresh output: no second [rows, out] tensor
                return None
            return output + delta.to(output.dtype)

        return hook

    def remove(self) -> None:
        """Take the hooks off (the model is exactly as loaded)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.deactivate()


def _sharded_output(active: ActiveBatch, name: str, style: str, x: Any, output: Any) -> Any:
    """A tensor-parallel linear's output plus its delta. Its input and output are DTensors (DTensor's
    ``ColwiseParallel`` / ``RowwiseParallel``): column-parallel, this rank's output columns from ``B``'s rows;
    row-parallel, a partial sum from ``A``'s columns — added to the partial output (no bias: DTensor sums both
    in its one all-reduce), or, when the linear already summed its output (a bias makes DTensor reduce inside
    the linear), after summing the rank-sized ``x A^T`` over the ranks (one small all-reduce)."""
    from torch.distributed.tensor import DTensor, Partial

    local = x.to_local() if isinstance(x, DTensor) else x
    if not isinstance(output, DTensor):
        delta = active.delta(name, local)
        return None if delta is None else output + delta.to(output.dtype)
    reduce = None
    if style == "row" and not any(isinstance(p, Partial) for p in output.placements):
        import torch.distributed as dist

        group = output.device_mesh.get_group()

        def reduce(t: Any) -> None:
            dist.all_reduce(t, group=group)

    delta = active.delta(name, local, reduce=reduce)
    if delta is None:
        return None
    wrapped = DTensor.from_local(delta.to(output.dtype), output.device_mesh, output.placements, run_check=False,
                                 shape=output.shape, stride=output.stride())
    return output + wrapped


__all__ = ["ActiveBatch", "LoRARuntime", "active_loras"]
