"""Regional ``torch.compile``: each repeated transformer block is compiled, and every block of a class shares the
compiled code.

A DiT is a stack of identical blocks. Compiling the whole model makes one huge graph that recompiles whenever any
part of the request changes; compiling each block instead (as diffusers' ``compile_repeated_blocks`` and the
reference system's recipes do) gives one small graph per block class. With ``inline_inbuilt_nn_modules`` (torch's
default since 2.5) a block's parameters are graph inputs rather than constants, so the graph compiled for block 0
is reused by blocks 1..N-1 — compile time is that of one block.

A pipeline names its regions with ``compile_regions``: dotted paths (from the pipeline) to module lists whose
elements are compiled one by one. Without that attribute the blocks of ``pipeline.block_loop`` are used.

Shapes: the first call of a shape compiles a static graph; a second shape makes dynamo mark the changing sizes
dynamic and compile once more (``automatic_dynamic_shapes``), so a deployment's size/duration buckets cost a small,
bounded number of graphs. Dynamo's own ``recompile_limit`` bounds the rest (past it the block runs eager, and torch
warns); each recompilation is logged through torch's ``recompiles`` log when the engine logs at INFO (``--verbose``).

What does not combine, refused at load with the reason: weight offload (``layerwise`` replaces a block's weights
inside its forward hooks, ``model`` moves them between devices every request, so the graphs would be re-guarded
each time) and ``--parallel`` (the worker ranks load their own copy; compiling collectives is not wired yet).
Attention runs outside the compiled graphs (:func:`outside_graph`): a backend walks host-side document lengths and
calls its own kernels (SDPA per document, a varlen kernel), which dynamo cannot and need not trace, so each block
compiles as the graphs before and after its attention call. Cache methods work unchanged: step caches run around the
model call, block caches call the compiled blocks, and the AdaLN schedule table lookup is excluded from compilation
by the projection itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from .errors import InvalidRequest, UnsupportedFeature

if TYPE_CHECKING:
    from torch import nn

F = TypeVar("F", bound=Callable[..., object])

logger = logging.getLogger("omnicore.compile")

COMPILE_MODES = ("none", "blocks", "blocks-cudagraphs")


def normalize_compile(value: bool | str | None) -> str:
    """``True``/``"blocks"`` → ``"blocks"``; ``False``/``None``/``"none"`` → ``"none"``; else ``InvalidRequest``."""
    if value is True:
        return "blocks"
    if value is False or value is None:
        return "none"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise InvalidRequest("compile", f"must be one of {list(COMPILE_MODES)} (or a bool), got {value!r}")


def check_compile(mode: str, *, model: str, platform: str, offload: str, parallel: bool) -> None:
    """The combinations refused before any weight is read (each message says why)."""
    if mode == "none":
        return
    if offload != "none":
        raise UnsupportedFeature("compile", f"--compile {mode} cannot be combined with --offload {offload}: offload "
                                 "moves or replaces the block weights around every call, so the compiled blocks "
                                 "would be re-guarded (and recompiled) each time; use one or the other")
    if parallel:
        raise UnsupportedFeature("compile", f"--compile {mode} with --parallel is not supported yet (each worker "
                                 "rank loads its own copy and the collectives inside a block are not compiled); "
                                 "run without --parallel to compile")
    if mode == "blocks-cudagraphs" and platform != "cuda":
        raise UnsupportedFeature("compile", f"--compile blocks-cudagraphs needs the cuda platform (CUDA graphs), "
                                 f"not {platform!r}; use --compile blocks")


def outside_graph(fn: F) -> F:
    """``fn`` excluded from compilation (called eagerly from inside a compiled block)."""
    import torch

    return torch.compiler.disable(fn)


def compile_regions(pipeline: object) -> tuple[str, ...]:
    """The module-list paths the pipeline declares for regional compilation (``compile_regions``, else its
    ``block_loop``); empty when it declares neither."""
    declared = getattr(pipeline, "compile_regions", None)
    if declared is not None:
        return tuple(declared)
    loop = getattr(pipeline, "block_loop", None)
    blocks = getattr(loop, "blocks", None)
    return (blocks,) if isinstance(blocks, str) else ()


def _blocks(pipeline: object, path: str) -> list[nn.Module]:
    """The modules at dotted ``path``; a part may also be a key of a mapping (``transformers.fl2va.blocks``)."""
    blocks = pipeline
    for part in path.split("."):
        if isinstance(blocks, Mapping) and part in blocks:
            blocks = blocks[part]
        elif hasattr(blocks, part):
            blocks = getattr(blocks, part)
        else:
            raise UnsupportedFeature("compile", f"compile region {path!r} does not name an attribute of "
                                                f"{type(pipeline).__name__}")
    if not isinstance(blocks, Iterable):
        raise UnsupportedFeature("compile", f"compile region {path!r} is not a list of blocks")
    return list(blocks)


@attrs.define(eq=False)
class RegionalCompile:
    """The blocks compiled on a pipeline; :meth:`remove` returns them to eager execution."""

    mode: str
    regions: tuple[str, ...]
    blocks: list[nn.Module] = attrs.Factory(list)

    @property
    def classes(self) -> tuple[str, ...]:
        """Block classes compiled: one compiled graph family each."""
        return tuple(dict.fromkeys(type(b).__name__ for b in self.blocks))

    def remove(self) -> None:
        for block in self.blocks:
            block._compiled_call_impl = None  # nn.Module.compile's slot: back to the eager __call__
        self.blocks.clear()


def apply_regional_compile(pipeline: object, mode: str, *, dynamic: bool | None = None,
                           options: dict[str, Any] | None = None, log_recompiles: bool = False) -> RegionalCompile:
    """Compile every block of the pipeline's compile regions in place (lazily: the first call compiles).

    ``dynamic=None`` is torch's default: static first, dynamic sizes after a second shape is seen.
    """
    name = getattr(getattr(pipeline, "spec", None), "name", type(pipeline).__name__)
    regions = compile_regions(pipeline)
    if not regions:
        raise UnsupportedFeature("compile", f"model {name!r} declares no compile regions (compile_regions or "
                                            "block_loop), so --compile has nothing to compile")
    import torch

    if log_recompiles:
        torch._logging.set_logs(recompiles=True)
    handle = RegionalCompile(mode=mode, regions=regions)
    torch_mode = "reduce-overhead" if mode == "blocks-cudagraphs" else None
    try:
        for path in regions:
            blocks = _blocks(pipeline, path)
            for block in blocks:
                if not isinstance(block, torch.nn.Module):
                    raise UnsupportedFeature("compile", f"compile region {path!r} holds a "
                                                        f"{type(block).__name__}, not a torch module")
                block.compile(dynamic=dynamic, mode=torch_mode, options=options)
                handle.blocks.append(block)
    except BaseException:
        handle.remove()
        raise
    logger.info("compile: %d blocks of %s (%s) compiled per block class: %s", len(handle.blocks), name,
                ", ".join(regions), ", ".join(handle.classes))
    return handle


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (for tests and benchmarks: bounded recompilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
