"""A diffusers modular pipeline driven by omnicore's engine, one denoise-loop iteration per ``denoise_step``.

A modular pipeline is a tree of blocks: sequential ones run their children in order, conditional (auto) ones pick
one child from the state's trigger inputs, and one *loop wrapper* (``LoopSequentialPipelineBlocks``: FLUX's
``FluxDenoiseStep``, Wan's, SDXL's ...) runs its leaf sub-blocks once per timestep. ``ModularRun`` walks that tree
itself, in the order ``ModularPipeline.__call__`` would, and splits the run at the loop:

- ``start``: the blocks before the loop (text encoding, latent preparation, timesteps), then the wrapper's own
  set-up up to its first ``loop_step`` call, where the wrapper's ``BlockState`` is taken over (the wrapper is
  left by an exception raised from that call, before any sub-block ran);
- ``step(i)``: one ``loop_step(components, block_state, i=i, t=timesteps[i])`` — the sub-blocks of one
  iteration (denoiser, guidance, scheduler step) over the state the engine owns;
- ``select(rows)``: drops rows of a batch (cancelled requests) from every per-row value: tensors and lists whose
  first dimension is the row count in the block state and the pipeline state, and the scheduler's per-row history
  (multistep solvers keep past model outputs);
- ``finish``: writes the loop's outputs back (``set_block_state``) and runs the blocks after the loop (unpacking,
  VAE decode), returning the state value the pipeline was asked for.

The wrapper's ``__call__`` is not run past its set-up, so what it does after its loop (nothing but progress bars in
the wrappers diffusers ships) is skipped. A tree the driver cannot split — a loop under a block whose own
``__call__`` is not the generic sequential / conditional one, a wrapper that does not iterate its ``timesteps``
with ``i`` and ``t`` only — raises :class:`NotSteppable` from ``start`` (before a row was denoised), and the adapter
falls back to running ``__call__`` on a thread parked after each scheduler step. A second loop in the same run
(two-stage pipelines) runs whole inside ``finish``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

#: position-id tensors (FLUX / QwenImage ``txt_ids``, ``img_ids``) have a sequence, not a row, first dimension
ROW_FREE_SUFFIXES = ("_ids",)


class NotSteppable(Exception):
    """The pipeline's block tree cannot be split at its denoise loop (the message says why)."""


class _LoopEntered(Exception):
    """Raised from the wrapper's first ``loop_step`` call to take over its block state."""

    def __init__(self, components: Any, block_state: Any, kwargs: dict[str, Any]) -> None:
        super().__init__("loop entered")
        self.components, self.block_state, self.kwargs = components, block_state, kwargs


def _classes() -> tuple[Any, Any, Any]:
    from diffusers.modular_pipelines.modular_pipeline import (
        ConditionalPipelineBlocks,
        LoopSequentialPipelineBlocks,
        SequentialPipelineBlocks,
    )

    return SequentialPipelineBlocks, ConditionalPipelineBlocks, LoopSequentialPipelineBlocks


def _contains_loop(block: Any) -> bool:
    loop = _classes()[2]
    return isinstance(block, loop) or any(_contains_loop(b) for b in (getattr(block, "sub_blocks", None) or {})
                                          .values())


def unsteppable_reason(blocks: Any) -> str | None:
    """Why ``blocks`` cannot be driven step by step (``None``: it can), from the tree alone."""
    sequential, conditional, loop = _classes()
    if isinstance(blocks, loop):
        return None if "timesteps" in {p.name for p in blocks.loop_inputs} else \
            f"{type(blocks).__name__} does not loop over timesteps"
    if not _contains_loop(blocks):
        return None
    generic = (isinstance(blocks, sequential) and type(blocks).__call__ is sequential.__call__) or \
              (isinstance(blocks, conditional) and type(blocks).__call__ is conditional.__call__)
    if not generic:
        return f"its denoise loop runs inside {type(blocks).__name__}.__call__"
    for sub in blocks.sub_blocks.values():
        reason = unsteppable_reason(sub)
        if reason is not None:
            return reason
    return None


def _walk(block: Any, pipe: Any, state: Any) -> Iterator[Any]:
    """Run ``block`` over ``state`` as diffusers would, yielding each loop wrapper instead of running it."""
    sequential, conditional, loop = _classes()
    if isinstance(block, loop):
        yield block
    elif isinstance(block, conditional) and type(block).__call__ is conditional.__call__:
        triggers = {name: state.get(name) for name in block.block_trigger_inputs if name is not None}
        chosen = block.select_block(**triggers) or block.default_block_name
        if chosen is not None:
            yield from _walk(block.sub_blocks[chosen], pipe, state)
    elif isinstance(block, sequential) and type(block).__call__ is sequential.__call__:
        for sub in block.sub_blocks.values():
            yield from _walk(sub, pipe, state)
    else:
        block(pipe, state)  # a leaf (or a block with its own __call__ and no loop inside): it updates state


def initial_state(blocks: Any, kwargs: dict[str, Any]) -> Any:
    """The pipeline state a call with ``kwargs`` starts from: each declared input from ``kwargs``, else its
    declared default (``kwargs_type`` groups, e.g. ``denoiser_input_fields``, may be passed as one dict)."""
    from diffusers.modular_pipelines.modular_pipeline import PipelineState

    state, given = PipelineState(), dict(kwargs)
    for param in blocks.inputs:
        if param.name in given:
            state.set(param.name, given.pop(param.name), param.kwargs_type)
        elif param.kwargs_type is not None and param.kwargs_type in given:
            for key, value in given.pop(param.kwargs_type).items():
                state.set(key, value, param.kwargs_type)
        elif param.name is not None and param.name not in state.values:
            state.set(param.name, param.default, param.kwargs_type)
    if given:
        raise ValueError(f"not inputs of {type(blocks).__name__}: {', '.join(sorted(given))}")
    return state


def take_rows(value: Any, rows: Sequence[int], count: int) -> Any:
    """``value`` restricted to ``rows`` when it is per-row (first dimension ``count``), else unchanged. Lists of
    numbers (sigmas, sizes) are never per-row."""
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == count:
        return value[torch.as_tensor(list(rows), device=value.device)]
    if isinstance(value, list) and len(value) == count and not any(isinstance(v, (int, float)) for v in value):
        return [value[i] for i in rows]
    return value


class ModularRun:
    """One batch's run of a modular pipeline, split at its denoise loop (see the module docstring)."""

    def __init__(self, pipe: Any, kwargs: dict[str, Any], output: str) -> None:
        self.pipe, self.output = pipe, output
        self._kwargs = kwargs
        self._walk: Iterator[Any] | None = None
        self.state: Any = None
        self.loop: Any = None
        self.block_state: Any = None
        self.components: Any = None
        self.timesteps: Any = None
        self.rows = 0
        self.step_times: list[float] = []

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else len(self.timesteps)

    @torch.no_grad()
    def start(self, rows: int) -> int:
        """Run up to the loop's first iteration; returns the number of loop iterations (each one a scheduler
        step: an order-2 solver's two evaluations of one step are two iterations). ``rows``: the batch's rows."""
        reason = unsteppable_reason(self.pipe._blocks)
        if reason is not None:
            raise NotSteppable(reason)
        self.rows = rows
        self.state = initial_state(self.pipe._blocks, self._kwargs)
        self._walk = _walk(self.pipe._blocks, self.pipe, self.state)
        loop = next(self._walk, None)
        if loop is None:  # no loop on this path: the whole run is done
            return 0
        self.loop = loop
        entered = self._enter(loop)
        if entered is None:  # the wrapper ran no iteration (e.g. strength 0): its outputs are in the state
            self.loop = None
            return 0
        names = sorted(entered.kwargs)
        timesteps = getattr(entered.block_state, "timesteps", None)
        if names != ["i", "t"] or entered.kwargs["i"] != 0 or timesteps is None or not len(timesteps) \
                or not torch.equal(torch.as_tensor(entered.kwargs["t"]), torch.as_tensor(timesteps[0])):
            raise NotSteppable(f"{type(loop).__name__} does not iterate its timesteps with loop_step(i=, t=)")
        self.components, self.block_state, self.timesteps = entered.components, entered.block_state, timesteps
        return len(timesteps)

    def _enter(self, loop: Any) -> _LoopEntered | None:
        """Run the wrapper's own set-up until its first ``loop_step`` call (``None``: it made none)."""
        def enter(components: Any, block_state: Any, **kwargs: Any) -> Any:
            raise _LoopEntered(components, block_state, kwargs)

        loop.loop_step = enter  # an instance attribute: the class's loop_step stays for the steps
        try:
            loop(self.pipe, self.state)
        except _LoopEntered as entered:
            return entered
        finally:
            del loop.loop_step
        return None

    @torch.no_grad()
    def step(self, index: int) -> None:
        """One loop iteration (the sub-blocks of step ``index``)."""
        began = time.perf_counter()
        self.components, self.block_state = self.loop.loop_step(self.components, self.block_state, i=index,
                                                                t=self.timesteps[index])
        self.step_times.append(time.perf_counter() - began)

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the batch rows ``rows`` (in order) of every per-row value the rest of the run reads."""
        count, keep = self.rows, list(rows)
        loop_inputs = {p.name for p in self.loop.loop_inputs} if self.loop is not None else set()

        def per_row(name: str) -> bool:
            return name not in loop_inputs and not name.endswith(ROW_FREE_SUFFIXES)

        if self.block_state is not None:
            for name, value in list(vars(self.block_state).items()):
                if per_row(name):
                    setattr(self.block_state, name, take_rows(value, keep, count))
        for name, value in list(self.state.values.items()):
            if per_row(name):
                self.state.values[name] = take_rows(value, keep, count)
        scheduler = getattr(self.pipe, "scheduler", None)
        for name, value in list(vars(scheduler).items()) if scheduler is not None else ():
            if isinstance(value, torch.Tensor) and value.ndim >= 2:
                setattr(scheduler, name, take_rows(value, keep, count))
            elif isinstance(value, list) and any(isinstance(v, torch.Tensor) and v.ndim >= 2 for v in value):
                setattr(scheduler, name, [take_rows(v, keep, count) for v in value])
        self.rows = len(keep)

    @torch.no_grad()
    def finish(self) -> Any:
        """The loop's outputs into the pipeline state, then the blocks after the loop; the requested output."""
        if self.loop is not None:
            self.loop.set_block_state(self.state, self.block_state)
            self.loop = None
        for later_loop in self._walk or ():
            later_loop(self.pipe, self.state)
        return self.state.get(self.output)
