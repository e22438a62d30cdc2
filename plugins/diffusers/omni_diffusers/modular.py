"""diffusers' modular pipelines (``ModularPipeline``, a ``modular_model_index.json`` checkpoint) behind the adapter.

A modular pipeline is a sequence of blocks (text encoding, latent preparation, a denoise *loop* block, decode)
rather than one ``__call__`` with a fixed signature, and it takes no ``callback_on_step_end``. Three things differ
from a stock ``DiffusionPipeline``, and this module supplies them:

- loading: ``ModularPipeline.from_pretrained`` reads the index, ``load_components`` loads what it names; a
  component whose folder sits in the checkpoint directory is read from there (the index diffusers writes records
  the absolute directory it was saved to, which is stale once the checkpoint is copied or moved);
- the signature: the blocks' declared inputs (``InputParam`` name, default, type hint) stand in for ``__call__``'s
  parameters, so the card (modes, roles, defaults, pass-through ``extra`` keys) is read the same way;
- step boundaries: the engine drives the denoise loop itself, one iteration per ``denoise_step``
  (:mod:`omni_diffusers.modular_driver`); a block tree the driver cannot split at its loop runs as one call on a
  thread parked right after each ``scheduler.step`` returns (see :class:`~omni_diffusers.stepper.SteppedCall`'s
  ``scheduler``).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

INDEX = "modular_model_index.json"


def is_modular(pipe: Any) -> bool:
    from diffusers.modular_pipelines import ModularPipeline

    return isinstance(pipe, ModularPipeline)


def load_modular(path: Path, dtype: Any, device: Any) -> Any:
    """The modular pipeline of ``path`` with every component loaded (local folders preferred), on ``device``."""
    from diffusers.modular_pipelines import ModularPipeline
    from omnicore.plugin import CheckpointError

    try:
        pipe = ModularPipeline.from_pretrained(str(path))
    except (ValueError, OSError, KeyError, AttributeError) as exc:  # diffusers could not resolve the blocks
        raise CheckpointError("diffusers", Path(path) / INDEX, f"not a loadable modular pipeline: {exc}") from exc
    index = json.loads((Path(path) / INDEX).read_text())
    local = {name: str(path) for name, entry in index.items()
             if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict)
             and (Path(path) / str(entry[2].get("subfolder") or name)).is_dir()}
    kwargs: dict[str, Any] = {}
    if local:
        kwargs["pretrained_model_name_or_path"] = local
    if dtype is not None:
        kwargs["dtype"] = dtype
    pipe.load_components(**kwargs)
    quiet(pipe._blocks)  # the executed blocks (the public .blocks is a deep copy)
    return pipe.to(device)


def quiet(block: Any) -> None:
    """No tqdm bar from any loop block, however deeply nested (the pipeline's own setter reaches only its direct
    sub-blocks): omnicore reports progress itself."""
    if hasattr(block, "set_progress_bar_config") and hasattr(block, "progress_bar"):
        block.set_progress_bar_config(disable=True)
    for sub in getattr(block, "sub_blocks", {}).values():
        quiet(sub)


def block_parameters(pipe: Any) -> dict[str, inspect.Parameter]:
    """The blocks' inputs as keyword parameters (what ``inspect.signature(__call__)`` gives a stock pipeline)."""
    params: dict[str, inspect.Parameter] = {}
    blocks = getattr(pipe, "_blocks", None) or pipe.blocks  # .blocks deep-copies the whole block tree
    for item in blocks.inputs:
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name.isidentifier() or name in params:
            continue
        default = getattr(item, "default", None)
        hint = getattr(item, "type_hint", None)
        params[name] = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                         default=inspect.Parameter.empty if default is None else default,
                                         annotation=inspect.Parameter.empty if hint is None else hint)
    return params


def steps_planned(scheduler: Any) -> int | None:
    """How many ``scheduler.step`` calls the loop will make once the scheduler's timesteps are set (``None``
    before that): the timesteps after the begin index an image-to-image strength sets. Not divided by the
    scheduler's ``order``: an order-2 solver (Heun) steps once per timestep too (its two evaluations of one step
    are two loop iterations), and every one of them is a step the engine reports and may cancel at."""
    timesteps = getattr(scheduler, "timesteps", None)
    if timesteps is None:
        return None
    begin = getattr(scheduler, "begin_index", None) or 0
    return max(0, len(timesteps) - int(begin))


def output_name(video: bool) -> str:
    """The pipeline state key the decode block writes (``images`` or ``videos``)."""
    return "videos" if video else "images"
