"""``omnicore plan``: what fits where, before anything is loaded.

A plan reads a checkpoint's configs (and, where there are weights, only the safetensors headers), builds every
component on the meta device through the model plugin's own builders, and prices candidate placements (one
device, model / layer-wise offload, Ulysses, CFG-parallel, tensor and expert parallel where the model declares
how it splits, and their combinations) with and without weight-only int8 / fp8 quantization. Weight bytes are
exact for the built modules; activation peaks are estimates from a stated formula (see
:mod:`omnicore.planning.estimate`). The JSON form is documented in ``docs/plan-json.md``.

A model plugin takes part by giving the module of its tiny presets (``spec.presets[0].builder``) two functions
and, optionally, real-size presets:

* ``plan_model(root, dtype) -> dict``: ``components`` (name -> meta-device module, cast as the loader casts it),
  ``dit`` (the component denoised with), ``offload_modules`` (the components ``--offload model`` moves, as the
  pipeline's ``offload_modules`` declares them), optional ``offload_modes`` (default both ``model`` and
  ``layerwise``),
  ``shape`` (``layers``, ``hidden``, ``heads``, ``head_dim``, ``ffn``, ``block_prefix``), ``quantizable``
  (component -> ``fnmatch`` patterns of linears), ``cfg_capable``, optional ``tp_plans`` (component ->
  the :class:`~omnicore.parallel.tensor_parallel.TensorParallelPlan` its loader shards with), optional
  ``experts`` (``{"count": routed experts, "modules": component -> patterns of the stacked-expert modules}``:
  ``ep`` rows split them on the expert dim), optional ``shard`` (``(tp, ep) -> {component: module}``: rank 0's
  components under that placement, narrowed on the meta device by the loader's own code; used instead of
  ``tp_plans`` / ``experts`` when given; a degree the model refuses raises ``ConfigError``) and ``provenance``.
  The quantizer reads ``quantization_targets(pipeline)`` from the same module.
* ``plan_request(root, request) -> dict``: ``tokens`` (DiT rows per forward and branch), ``cfg_branches``,
  ``steps`` and ``resolved`` (the request after the model's own rules), optional ``adaln_rows_per_step`` and
  ``cache_elements`` (cache name -> elements in the plan's dtype, e.g. a prompt K/V).
* ``REAL_PRESETS``: ``{"real:<model>": "module:builder"}``; the builder writes a configs-only repository.
"""

from __future__ import annotations

from .estimate import SCHEMA_VERSION, CostModel, Placement, Plan, make_plan
from .source import PlanSource, read_safetensors_header, real_presets, resolve_source

__all__ = ["SCHEMA_VERSION", "CostModel", "Placement", "Plan", "PlanSource", "make_plan", "read_safetensors_header",
           "real_presets", "resolve_source"]
