"""Helpers shared by the engine tests (not a test module)."""

from __future__ import annotations

import threading

from omnicore.hookspecs import hookimpl


class StepGate:
    """Holds the worker before denoise step ``at_step`` of any batch containing a request tagged ``tag``.

    ``reached`` is set when the worker arrives; it continues once ``release`` is set.
    """

    def __init__(self, at_step: int, tag: str = "gate") -> None:
        self.at_step = at_step
        self.tag = tag
        self.reached = threading.Event()
        self.release = threading.Event()

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline, state, step):
        if step == self.at_step and any(r.extra.get("tag") == self.tag for r in state.requests):
            self.reached.set()
            assert self.release.wait(30), "test never released the gate"
        return (yield)


class PreprocessCounter:
    """Counts ``omnicore_preprocess`` hook calls per request id and records the thread they ran on."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.threads: dict[str, int] = {}
        self.returned: dict[str, object] = {}

    @hookimpl(wrapper=True)
    def omnicore_preprocess(self, request, pipeline):
        self.calls[request.request_id] = self.calls.get(request.request_id, 0) + 1
        self.threads[request.request_id] = threading.get_ident()
        prepared = yield
        self.returned[request.request_id] = prepared
        return prepared
