"""Per-request adapters on a loaded model, without merging: :class:`LoRARuntime`.

The runtime puts a forward hook on every adaptable ``nn.Linear`` of the model (the first time a batch brings an
adapter; the base weights are never touched). Before each forward the engine tells it the batch's requests
(:meth:`LoRARuntime.activate`); each hooked linear then adds, per row, the delta of that row's adapter set through
the platform op ``lora_segment_delta`` — one grouped call per linear for the whole mixed batch. Rows whose request
has no adapter add nothing, and with no adapter in the batch the hooks return at once (bit-identical outputs).

Several adapters on one request are one slot with their ranks concatenated (``[A1; A2]``, ``[s1 B1 | s2 B2]``),
which is exactly the sum of their deltas; scales are folded into ``B``; an adapter with scale 0 is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import LoRAError
from .records import LoRA
from .registry import AdapterRegistry, DeviceAdapter
from .rows import current_off, current_packed, current_samples
from .targets import TargetMap, resolve_roots

if TYPE_CHECKING:
    import torch

    from ..engine.request import GenerationRequest
    from ..specs import ModelSpec

logger = logging.getLogger("omnicore.lora")

#: one adapter set: ((device adapter, request scale), ...); the empty set is "no adapter"
AdapterSet = tuple[tuple[DeviceAdapter, float], ...]


def active_loras(request: GenerationRequest) -> tuple[LoRA, ...]:
    """The request's adapters that change anything (scale 0 is exactly no adapter)."""
    return tuple(lora for lora in request.loras if lora.scale != 0.0)


class ActiveBatch:
    """The adapter sets of one batch's outputs and the stacked slots each linear needs (built once per batch)."""

    def __init__(self, output_sets: Sequence[int], sets: Sequence[AdapterSet], ops: Any) -> None:
        self.output_sets = tuple(output_sets)  # output i -> index into sets (0 = none)
        self.sets = tuple(sets)
        self.ops = ops
        self._set_slots: dict[tuple[str, int], tuple[Any, Any] | None] = {}
        self._stacked: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
        # (which sets adapt the module, input shape, row scopes) -> (seg ends, set ids, host seg_ends tensor):
        # every linear of a forward with the same answer shares one computation
        self._segments: dict[tuple[Any, ...], tuple[list[int], list[int], Any]] = {}

    @property
    def signature(self) -> tuple[Any, ...]:
        return (self.output_sets, tuple(tuple((a.key, s) for a, s in group) for group in self.sets))

    def _slot(self, name: str, set_id: int) -> tuple[Any, Any] | None:
        """``(A [R, in], B [out, R])`` of set ``set_id`` on module ``name`` (ranks concatenated, scales folded)."""
        key = (name, set_id)
        if key not in self._set_slots:
            import torch

            parts = [(ad.modules[name][0], ad.modules[name][1] * scale) for ad, scale in self.sets[set_id]
                     if name in ad.modules]
            self._set_slots[key] = None if not parts else (
                torch.cat([a for a, _ in parts], 0), torch.cat([b for _, b in parts], 1))
        return self._set_slots[key]

    def touches(self, name: str) -> bool:
        return any(self._slot(name, s) is not None for s in range(1, len(self.sets)))

    def segments(self, name: str, x: torch.Tensor) -> tuple[list[int], list[int]]:
        """``(seg_ends, set ids)`` over the rows of ``x`` (equal neighbouring sets merged)."""
        fan_in = x.shape[-1]
        rows = x.numel() // fan_in if fan_in else 0
        packed = current_packed()
        bounds: list[tuple[int, int]] = []  # (row end, forward sample or -1 for padding)
        if packed is not None and x.dim() == 2 and rows == packed.num_rows:
            bounds = [(end, j) for j, end in enumerate(packed.ends)]
            if not packed.ends or packed.ends[-1] < rows:
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
        ends: list[int] = []
        ids: list[int] = []
        for end, j in bounds:
            set_id = self.output_sets[outputs[j]] if j >= 0 else 0
            if self._slot(name, set_id) is None:
                set_id = 0
            if ids and ids[-1] == set_id:
                ends[-1] = end
            elif not ends or end > ends[-1]:
                ends.append(end)
                ids.append(set_id)
        return ends, ids

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The ``[..., out]`` delta of module ``name`` on input ``x``, or None when no row of it is adapted."""
        if not self.touches(name) or current_off():
            return None
        import torch

        seg_key = (tuple(self._slot(name, s) is not None for s in range(len(self.sets))), tuple(x.shape),
                   current_packed(), current_samples())
        found = self._segments.get(seg_key)
        if found is None:
            ends, ids = self.segments(name, x)
            found = (ends, ids, torch.tensor(ends, dtype=torch.int64))
            self._segments[seg_key] = found
        ends, ids, seg_ends = found
        if not any(ids):
            return None
        key = (name, tuple(ids), x.device, x.dtype)
        stacked = self._stacked.get(key)
        if stacked is None:
            slots = [self._slot(name, i) for i in ids]
            rank = max(s[0].shape[0] for s in slots if s is not None)
            some = next(s for s in slots if s is not None)
            fan_in, fan_out = some[0].shape[1], some[1].shape[0]
            a = some[0].new_zeros((len(ids), rank, fan_in))
            b = some[1].new_zeros((len(ids), fan_out, rank))
            for k, slot in enumerate(slots):
                if slot is not None:
                    a[k, : slot[0].shape[0]] = slot[0]
                    b[k, :, : slot[1].shape[1]] = slot[1]
            stacked = (a.to(device=x.device), b.to(device=x.device), None)
            self._stacked[key] = stacked
        a, b, _ = stacked
        rows = x.reshape(-1, x.shape[-1])
        out = self.ops.lora_segment_delta(rows, a, b, seg_ends)
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
    def activate(self, requests: Sequence[GenerationRequest]) -> None:
        """Make the hooked linears use these requests' adapters (in batch order, ``num_outputs`` rows each)."""
        wanted = [active_loras(r) for r in requests]
        if not any(wanted):
            self._active, self._active_for = None, None
            return
        # the same requests as the last call (the next step of a batch): the same adapters, not looked up again,
        # so a batch keeps the adapter versions it started with even if a file changes on disk meanwhile
        ident = tuple((r.request_id, loras, r.params.num_outputs) for r, loras in zip(requests, wanted))
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
        for request, loras in zip(requests, wanted):
            group = []
            for lora in loras:
                adapter = self.registry.device_adapter(lora, self.target_map, device, self._dtype(dtype), keep)
                keep.append(adapter.key)
                group.append((adapter, lora.scale))
            set_key = tuple((a.key, s) for a, s in group)
            if set_key not in index:
                index[set_key] = len(sets)
                sets.append(tuple(group))
            output_sets.extend([index[set_key]] * request.params.num_outputs)
        batch = ActiveBatch(output_sets, sets, self.ops)
        if self._active is None or self._active.signature != batch.signature:
            self._active = batch
        self._active_for = ident

    def _dtype(self, dtype: Any) -> Any:
        import torch

        return dtype if dtype is not None else torch.float32

    def deactivate(self) -> None:
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
                self._hooks.append(modules[name].register_forward_hook(self._hook(name)))
        logger.info("LoRA hooks on %d linears of %s", len(self._hooks), self.spec.name)

    def _hook(self, name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
            active = self._active
            if active is None or not args:
                return None
            delta = active.delta(name, args[0])
            if delta is None:
                return None
            return output + delta.to(output.dtype)

        return hook

    def remove(self) -> None:
        """Take the hooks off (the model is exactly as loaded)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._active, self._active_for = None, None


__all__ = ["ActiveBatch", "LoRARuntime", "active_loras"]
