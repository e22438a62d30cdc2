"""``LoadOptions``' helpers: the load dtype, the device and the attention choice every model loader made by hand.

Each native plugin had its own ``_dtype_name`` and built ``AttentionRequirement(platform=..., dtype=...)`` itself;
these tests hold the one helper to what those copies did.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from omnicore.engine.protocol import LoadOptions  # noqa: E402
from omnicore.errors import UnsupportedFeature  # noqa: E402
from omnicore.platforms.cpu import CpuPlatform  # noqa: E402
from omnicore.plugin_host import PluginHost  # noqa: E402
from omnicore.specs import AttentionRequirement, dtype_name  # noqa: E402


class _Half(CpuPlatform):
    """A platform whose default dtype is not float32, so the fallback is visible."""

    name = "halfplat"

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16


def test_dtype_name_is_the_capability_vocabulary() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = dtype_name(dtype)
        assert getattr(torch, name) is dtype and not name.startswith("torch.")
    assert dtype_name("bfloat16") == "bfloat16"  # a name passes through


def test_torch_dtype_is_the_given_one_else_the_platform_default() -> None:
    assert LoadOptions(platform=_Half()).torch_dtype() is torch.bfloat16
    assert LoadOptions(platform=_Half(), dtype=torch.float16).torch_dtype() is torch.float16
    assert LoadOptions(platform=CpuPlatform()).device() == CpuPlatform().device()


def test_attention_requirement_names_the_platform_and_the_dtype() -> None:
    options = LoadOptions(platform=_Half())
    assert options.attention_requirement(torch.bfloat16, 128, packed_varlen=True) == AttentionRequirement(
        platform="halfplat", dtype="bfloat16", head_dim=128, packed_varlen=True)
    with pytest.raises(TypeError):
        options.attention_requirement(torch.float32, 64, no_such_flag=True)


def test_select_attention_asks_the_selector_once_or_returns_none_without_one() -> None:
    seen: list[AttentionRequirement] = []

    def selector(requirement: AttentionRequirement) -> object:
        seen.append(requirement)
        return print  # any callable stands for the chosen backend

    assert LoadOptions(platform=CpuPlatform()).select_attention(torch.float32, 64) is None
    chosen = LoadOptions(platform=CpuPlatform(), attention=selector).select_attention(torch.float32, 64, spans=True)
    assert chosen is print
    assert seen == [AttentionRequirement(platform="cpu", dtype="float32", head_dim=64, spans=True)]


def test_select_attention_through_the_host_picks_a_backend_or_raises_unmet() -> None:
    host = PluginHost(autoload=False)
    options = LoadOptions(platform=CpuPlatform(), attention=lambda r: host.select_attention(r).load_impl())
    assert callable(options.select_attention(torch.float32, 64, packed_varlen=True))
    with pytest.raises(UnsupportedFeature):
        options.select_attention(torch.float32, 4096)  # no backend takes that head dim
