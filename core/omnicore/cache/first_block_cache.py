"""First-block cache (the "FBCache" of ParaAttention / cache-dit; cf. Liu et al. TeaCache 2024 and the
"Δ-DiT" residual-caching line of work).

Each step runs the first transformer block, compares its residual (output − input of the hidden stream)
with the residual it had at the last computed step (relative L1), and, when the change is below
``threshold``, skips the remaining blocks by adding their residual cached at that computed step.

Model knowledge comes from a declaration, not a re-implemented forward: the pipeline exposes
``pipeline.block_loop`` (a :class:`BlockLoop`, or ``config.block_loop`` overrides) naming the module list of
transformer blocks and the streams a block takes and returns. Hooks (``omnicore.module_hooks``) are put on the
blocks; a step-cache plugin on the ``omnicore_denoise`` hook tells them, per step, whether reuse is allowed
(warm-up, last step, forced pattern ...) and resets their state when a new batch starts.

Calls of the transformer outside the denoise loop always compute and never touch the cache. A pipeline that
calls the transformer more than once per step (CFG branches) should name each call with
``omnicore.module_hooks.hook_context("cond")`` etc.; unnamed calls are told apart by their order within the step.

Over a worker group (``--parallel``) the relative L1 is summed over the ranks computing the same guidance branch
(:func:`omnicore.parallel.consensus.agreed_relative_l1`): a Ulysses rank holds only its rows, and ranks skipping
differently would stop in different collectives. The sums are float64 on one process too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import attrs

from ..blocks import BlockLoop
from ..errors import ConfigError, UnsupportedFeature
from ..module_hooks import ModelHook, StateManager, current_context, register_hook, remove_hook
from ..parallel.consensus import agreed_relative_l1, group_of
from ._step import RequestState, StepCache, StepCacheConfig, coerce_config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..engine.protocol import DenoiseState, Pipeline

#: The tensors a block takes and returns, in :attr:`BlockLoop.streams` order.
Streams = tuple["torch.Tensor", ...]

METHOD_NAME = "first_block_cache"
HEAD_HOOK = "omnicore.first_block_cache.head"
SKIP_HOOK = "omnicore.first_block_cache.skip"
TAIL_HOOK = "omnicore.first_block_cache.tail"


@attrs.define(kw_only=True)
class FirstBlockCacheConfig(StepCacheConfig):
    """``threshold``: relative-L1 change of the first block's residual below which the rest is reused
    (cache-dit's "residual_diff_threshold"; 0.04–0.12 typical). ``block_loop`` overrides the pipeline's."""

    threshold: float = 0.08
    block_loop: BlockLoop | None = None


@attrs.define
class _BranchState:
    head_residual: torch.Tensor | None = None  # first block's residual at the last computed step
    rest_residuals: Streams | None = None  # per stream: output of last block − output of block 0
    head_outputs: Streams | None = None
    skipping: bool = False


def _streams_in(names: tuple[str, ...], args: tuple[object, ...], kwargs: dict[str, object]) -> Streams:
    out: list[object] = []
    for i, name in enumerate(names):
        if name in kwargs:
            out.append(kwargs[name])
        elif i < len(args):
            out.append(args[i])
        else:
            raise TypeError(f"first_block_cache: block call lacks stream {name!r}")
    return cast(Streams, tuple(out))


def _streams_out(n: int, output: object) -> Streams:
    if n == 1:
        return cast(Streams, (output[0] if isinstance(output, tuple) else output,))
    if not isinstance(output, tuple) or len(output) < n:
        raise TypeError(f"first_block_cache: a block must return a tuple of {n} streams")
    return cast(Streams, tuple(output[:n]))


def _pack(streams: Streams) -> torch.Tensor | Streams:
    return streams[0] if len(streams) == 1 else streams


class _HeadHook(ModelHook):
    def __init__(self, cache: FirstBlockCache) -> None:
        self.cache = cache

    def new_forward(self, module: nn.Module, forward: Callable[..., object], *args: object,
                    **kwargs: object) -> object:
        cache = self.cache
        names = cache.loop.streams
        inputs = _streams_in(names, args, kwargs)
        output = forward(*args, **kwargs)
        outputs = _streams_out(len(names), output)
        branch = cache.begin_call()
        if branch is None:  # outside the denoise loop
            return output
        residual = outputs[0] - inputs[0]
        hit = False
        rest = branch.rest_residuals
        if (rest is not None and branch.head_residual is not None and cache.step_allows
                and cache.current_step is not None):
            forced = cache.forced(cache.current_step)
            hit = forced if forced is not None else (  # the same decision on every rank of a worker group
                agreed_relative_l1(residual, branch.head_residual, cache.group) < cache.threshold)
        branch.skipping = hit
        if hit and rest is not None:
            cache.note_hit()
            return _pack(tuple(o + r for o, r in zip(outputs, rest)))
        branch.head_residual = residual
        branch.head_outputs = outputs
        return output


class _SkipHook(ModelHook):
    def __init__(self, cache: FirstBlockCache, tail: bool) -> None:
        self.cache = cache
        self.tail = tail

    def new_forward(self, module: nn.Module, forward: Callable[..., object], *args: object,
                    **kwargs: object) -> object:
        cache = self.cache
        branch = cache.branch
        names = cache.loop.streams
        if branch is not None and branch.skipping:
            return _pack(_streams_in(names, args, kwargs))
        output = forward(*args, **kwargs)
        if self.tail and branch is not None and branch.head_outputs is not None:
            outs = _streams_out(len(names), output)
            branch.rest_residuals = tuple(o - h for o, h in zip(outs, branch.head_outputs))
            branch.head_outputs = None
        return output


class FirstBlockCache(StepCache):
    method = METHOD_NAME

    def __init__(self, pipeline: Pipeline, config: FirstBlockCacheConfig) -> None:
        if not config.threshold > 0:
            raise ConfigError("threshold", f"must be positive, got {config.threshold}")
        loop = config.block_loop if config.block_loop is not None else getattr(pipeline, "block_loop", None)
        if not isinstance(loop, BlockLoop):
            raise UnsupportedFeature(METHOD_NAME, f"{type(pipeline).__name__} declares no BlockLoop "
                                                  f"(pipeline.block_loop)")
        blocks = loop.resolve(pipeline)
        if len(blocks) < 2:
            raise UnsupportedFeature(METHOD_NAME, f"{loop.blocks!r} must hold at least two blocks")
        self.loop = loop
        self.blocks = blocks
        self.threshold: float = config.threshold
        self.group = group_of(pipeline)  # under --parallel: the change is summed over the branch's ranks
        self._branches = StateManager(_BranchState)
        self.branch: _BranchState | None = None
        self.current_step: int | None = None
        self.step_allows = False
        self._calls_this_step = 0
        self._hit_this_step = False
        super().__init__(pipeline, config)

    # ------------------------------------------------------------------ lifecycle
    def register(self) -> FirstBlockCache:
        super().register()
        installed: list[tuple[nn.Module, str]] = []
        hook: ModelHook
        try:
            for i, block in enumerate(self.blocks):
                if i == 0:
                    name, hook = HEAD_HOOK, _HeadHook(self)
                else:
                    last = i == len(self.blocks) - 1
                    name, hook = (TAIL_HOOK if last else SKIP_HOOK), _SkipHook(self, tail=last)
                register_hook(block, name, hook)
                installed.append((block, name))
        except Exception:
            for block, name in installed:
                remove_hook(block, name)
            super().remove()
            raise
        self._installed = installed
        return self

    def remove(self) -> None:
        for block, name in getattr(self, "_installed", ()):
            remove_hook(block, name)
        self._installed = []
        self._branches.reset()
        self.branch = None
        self.current_step = None
        super().remove()

    # ------------------------------------------------------------------ step protocol
    def on_new_state(self, rs: RequestState, state: DenoiseState) -> None:
        rs.data["branches"] = StateManager(_BranchState)  # request-scoped: batches never share residuals

    def has_cached(self, rs: RequestState) -> bool:
        return bool(rs.stats.computed)  # each branch also checks it holds residuals

    def decide(self, rs: RequestState, state: DenoiseState, step: int, permitted: bool) -> DenoiseState | None:
        self._branches = rs.data["branches"]
        self.current_step = step
        self.step_allows = permitted
        self._calls_this_step = 0
        self._hit_this_step = False
        self.branch = None
        return None  # the model always runs; the block hooks do the skipping

    def record(self, rs: RequestState, state: DenoiseState, step: int) -> bool:
        hit = self._hit_this_step  # the step ran block 0 only: it counts as a reuse
        self.current_step = None
        self.step_allows = False
        self.branch = None
        return hit

    # ------------------------------------------------------------------ called by the hooks
    def begin_call(self) -> _BranchState | None:
        if self.current_step is None:
            self.branch = None
            return None
        name = current_context()
        if name is None:
            name = f"call{self._calls_this_step}"
        self._calls_this_step += 1
        self.branch = self._branches.get(name)
        return self.branch

    def note_hit(self) -> None:
        self._hit_this_step = True


def apply_first_block_cache(pipeline: Pipeline, config: FirstBlockCacheConfig | dict[str, object] | None = None
                            ) -> FirstBlockCache:
    """Enable the first-block cache on ``pipeline``'s declared block loop; ``handle.remove()`` undoes it."""
    return FirstBlockCache(pipeline, coerce_config(FirstBlockCacheConfig, config, METHOD_NAME)).register()


def remove_first_block_cache(handle: FirstBlockCache) -> None:
    handle.remove()
