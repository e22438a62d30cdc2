"""Module-hook substrate: composition order, skipping, exact removal, duplicate names, contexts."""

from __future__ import annotations

import pytest
import torch
from omnicore.module_hooks import (
    HookRegistry,
    ModelHook,
    StateManager,
    current_context,
    get_hook,
    hook_context,
    register_hook,
    remove_hook,
)
from torch import nn


class _Log(ModelHook):
    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag, self.log = tag, log

    def pre_forward(self, module, *args, **kwargs):
        self.log.append(f"pre-{self.tag}")
        return args, kwargs

    def post_forward(self, module, output):
        self.log.append(f"post-{self.tag}")
        return output


class _Scale(ModelHook):
    """Doubles the input, adds one to the output."""

    def pre_forward(self, module, x):
        return (x * 2,), {}

    def post_forward(self, module, output):
        return output + 1


class _Skip(ModelHook):
    def __init__(self) -> None:
        self.skip = False

    def new_forward(self, module, forward, x):
        return x if self.skip else forward(x)


def test_hooks_rewrite_args_and_output_against_manual_computation():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    expected = lin(x * 2) + 1
    register_hook(lin, "scale", _Scale())
    torch.testing.assert_close(lin(x), expected, rtol=0, atol=0)


def test_later_hooks_wrap_earlier_ones():
    log: list[str] = []
    lin = nn.Linear(2, 2)
    register_hook(lin, "a", _Log("a", log))
    register_hook(lin, "b", _Log("b", log))
    lin(torch.zeros(1, 2))
    assert log == ["pre-b", "pre-a", "post-a", "post-b"]


def test_new_forward_can_skip_the_module():
    lin = nn.Linear(2, 2)
    hook = register_hook(lin, "skip", _Skip())
    x = torch.randn(1, 2)
    assert not torch.equal(lin(x), x)
    hook.skip = True
    assert torch.equal(lin(x), x)


def test_remove_restores_the_module_exactly():
    lin = nn.Linear(2, 2)
    before = dict(lin.__dict__)
    register_hook(lin, "a", _Scale())
    register_hook(lin, "b", _Skip())
    assert "forward" in lin.__dict__
    assert isinstance(remove_hook(lin, "a"), _Scale)
    assert remove_hook(lin, "b") is not None
    assert remove_hook(lin, "b") is None
    assert lin.__dict__.keys() == before.keys()
    assert HookRegistry.for_module(lin, create=False) is None
    x = torch.randn(1, 2)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=0, atol=0)


def test_duplicate_hook_name_is_an_error_not_an_overwrite():
    lin = nn.Linear(2, 2)
    first = register_hook(lin, "same", _Scale())
    with pytest.raises(ValueError, match="already exists"):
        register_hook(lin, "same", _Skip())
    assert get_hook(lin, "same") is first


def test_initialize_and_detach_are_called_once():
    calls: list[str] = []

    class H(ModelHook):
        def initialize_hook(self, module):
            calls.append("init")
            return module

        def detach_hook(self, module):
            calls.append("detach")
            return module

    lin = nn.Linear(2, 2)
    register_hook(lin, "h", H())
    remove_hook(lin, "h")
    assert calls == ["init", "detach"]


def test_named_contexts_select_state_explicitly():
    manager = StateManager(dict)
    assert current_context() is None
    with hook_context("cond"):
        assert current_context() == "cond"
        manager.get(current_context())["x"] = 1
        with hook_context("uncond"):
            manager.get(current_context())["x"] = 2
        assert current_context() == "cond"
    assert current_context() is None
    assert manager.get("cond") == {"x": 1} and manager.get("uncond") == {"x": 2}
    manager.reset()
    assert len(manager) == 0
