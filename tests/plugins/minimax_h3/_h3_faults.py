"""Faults injected into MiniMax-H3 on chosen ranks of a worker group (the failure tests of
``test_parallel_lockstep.py``): inside the text encoder's encode, just before layer 1's MLP of the Qwen3-VL decoder
(after the all-reduces of layer 0 and of layer 1's attention under ``tp``), or inside a denoise step, just before
DiT block 1. Only requests whose prompt carries the phase's mark fail, so the warm-up and every other request run
as usual.

Rank 0 (the test's own process) gets a fault with :func:`inject_encode` on its engine's pipeline; the worker ranks
(spawned processes) through ``_worker_group_helpers.at_worker_start(tmp, "_h3_faults:install_from_environment",
H3_TEST_FAULT="encode,step")``, which patches the classes in that worker before it loads anything.
"""

from __future__ import annotations

import os
import types
from typing import Any

ENCODE_MARK = "[fault in the encode]"
STEP_MARK = "[fault in a step]"
#: the denoise step the step fault strikes (step 0 completes on every rank first)
FAULT_STEP = 1
ENV = "H3_TEST_FAULT"


class InjectedFault(RuntimeError):
    """The injected failure (its message names the phase and the rank)."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _boom(where: str) -> Any:
    def hook(*_args: Any) -> None:
        raise InjectedFault(f"injected fault in {where} on rank {_rank()}")
    return hook


def _encode_with_fault(original: Any) -> Any:
    def encode(self: Any, prompt: str, items: Any = ()) -> Any:
        if ENCODE_MARK not in prompt:
            return original(self, prompt, items)
        handle = self.model.language_model.layers[1].mlp.register_forward_pre_hook(_boom("the text encoder"))
        try:
            return original(self, prompt, items)
        finally:
            handle.remove()
    return encode


def _predict_with_fault(original: Any) -> Any:
    def predict(self: Any, state: Any, step: int) -> Any:
        if step != FAULT_STEP or not any(STEP_MARK in r.prompt for r in state.requests):
            return original(self, state, step)
        handle = self.dit_for(state).blocks[1].register_forward_pre_hook(_boom(f"denoise step {step}"))
        try:
            return original(self, state, step)
        finally:
            handle.remove()
    return predict


def inject_encode(pipeline: Any) -> None:
    """Rank 0's copy: its text encoder fails on a request carrying :data:`ENCODE_MARK` (this instance only)."""
    from omni_minimax_h3.text_encoder import H3TextEncoder

    encoder = pipeline.text_encoder
    encoder.encode = types.MethodType(_encode_with_fault(H3TextEncoder.encode), encoder)


def clear_encode(pipeline: Any) -> None:
    """Undo :func:`inject_encode`."""
    del pipeline.text_encoder.encode


def install_from_environment() -> None:
    """In a worker process: patch the classes for the phases :data:`ENV` lists (``encode``, ``step``)."""
    phases = set(filter(None, os.environ.get(ENV, "").split(",")))
    if "encode" in phases:
        from omni_minimax_h3.text_encoder import H3TextEncoder

        H3TextEncoder.encode = _encode_with_fault(H3TextEncoder.encode)  # type: ignore[method-assign]
    if "step" in phases:
        from omni_minimax_h3.pipeline import MiniMaxH3Pipeline

        MiniMaxH3Pipeline.predict = _predict_with_fault(MiniMaxH3Pipeline.predict)  # type: ignore[method-assign]
