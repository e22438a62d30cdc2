"""Layer-wise and model-level offload on CPU: the "device" is the CPU too, so the transfer logic is checked
through the owned/excluded sets and the storage-emptied representation (released parameters keep their
object and device but hold zero elements)."""

from __future__ import annotations

import pytest
import torch
from omnicore.cache.adaln_schedule import EXCLUDED_OFFLOAD_PREFIXES
from omnicore.module_hooks import HookRegistry
from omnicore.offload import (
    LayerwiseOffloadConfig,
    apply_layerwise_offload,
    apply_model_offload,
    materialize,
    move_excluded,
)
from torch import nn


class AdaLN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)


class Block(nn.Module):
    """``weight`` plus ``adaln_proj.linear.{weight,bias}`` and a buffer, as in the reference contract."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(4, 4, generator=g))
        self.adaln_proj = AdaLN()
        self.register_buffer("scale", torch.full((4,), 1.0 + seed))
        self.seen: list[set[str]] = []

    def forward(self, x):
        # what is materialised while this block runs
        self.seen.append({n for n, p in self.named_parameters() if p.numel() > 0})
        return torch.tanh(x @ self.weight) * self.scale + self.adaln_proj.linear(x[:, :3]).sum(-1, keepdim=True)


def _blocks(n: int = 3) -> nn.ModuleList:
    return nn.ModuleList(Block(i) for i in range(n))


def _run(blocks, x):
    for b in blocks:
        x = b(x)
    return x


def _snapshot(blocks):
    return [{k: v.clone() for k, v in b.state_dict().items()} for b in blocks]


def test_owned_sets_exclude_cache_parameters():
    blocks = _blocks()
    handle = apply_layerwise_offload(blocks, device="cpu", excluded_prefixes=EXCLUDED_OFFLOAD_PREFIXES)
    for hook in handle.hooks:
        assert hook.owned == {"weight"} and hook.next_owned == {"weight"}
    handle.remove()
    handle = apply_layerwise_offload(blocks, device="cpu")
    assert handle.hooks[0].owned == {"weight", "adaln_proj.linear.weight", "adaln_proj.linear.bias"}
    handle.remove()


def test_after_init_next_block_is_emptied_and_adaln_untouched():
    blocks = _blocks()
    before = _snapshot(blocks)
    handle = apply_layerwise_offload(blocks, device="cpu", excluded_prefixes=EXCLUDED_OFFLOAD_PREFIXES)
    assert blocks[0].weight.numel() == 16  # the first block is ready
    for i in (1, 2):
        assert blocks[i].weight.numel() == 0 and blocks[i].weight.untyped_storage().nbytes() == 0
        assert torch.equal(blocks[i].adaln_proj.linear.weight, before[i]["adaln_proj.linear.weight"])
        assert torch.equal(blocks[i].adaln_proj.linear.bias, before[i]["adaln_proj.linear.bias"])
        assert torch.equal(blocks[i].scale, before[i]["scale"])  # buffers unaffected
    handle.hooks[0].offload_current()  # after offloading the current layer the same holds for it
    assert blocks[0].weight.numel() == 0
    assert torch.equal(blocks[0].adaln_proj.linear.weight, before[0]["adaln_proj.linear.weight"])
    handle.remove()


def test_forward_is_exact_and_only_current_and_next_blocks_are_resident():
    blocks = _blocks()
    x = torch.randn(2, 4)
    reference = _run(blocks, x)
    handle = apply_layerwise_offload(blocks, device="cpu", excluded_prefixes=EXCLUDED_OFFLOAD_PREFIXES)
    resident_during = []
    for b in blocks:
        b.register_forward_pre_hook(lambda m, a: resident_during.append(
            [blk.weight.numel() > 0 for blk in blocks]))
    for _ in range(2):  # two steps: block 0 is prefetched again by the last block
        torch.testing.assert_close(_run(blocks, x), reference, rtol=0, atol=0)
    # (pre-hooks registered after the offload hook run before it: block i is loaded by then only if prefetched)
    assert resident_during[0] == [True, False, False]
    assert resident_during[1] == [False, True, False]
    assert resident_during[2] == [False, False, True]
    assert resident_during[3] == [True, False, False]
    for b in blocks:  # inside forward: the block's owned and excluded parameters are all materialised
        assert all(s == {"weight", "adaln_proj.linear.weight", "adaln_proj.linear.bias"} for s in b.seen)
    assert [b.weight.numel() for b in blocks] == [16, 0, 0]
    handle.remove()
    assert all("forward" not in b.__dict__ and HookRegistry.for_module(b, create=False) is None for b in blocks)
    assert all(b.weight.numel() == 16 for b in blocks)
    torch.testing.assert_close(_run(blocks, x), reference, rtol=0, atol=0)


def test_without_prefetch_blocks_load_on_demand():
    blocks = _blocks()
    x = torch.randn(2, 4)
    reference = _run(blocks, x)
    handle = apply_layerwise_offload(blocks, LayerwiseOffloadConfig(device="cpu", prefetch=False))
    torch.testing.assert_close(_run(blocks, x), reference, rtol=0, atol=0)
    assert [b.weight.numel() for b in blocks] == [0, 0, 0]
    handle.remove()


def test_transfer_set_bytes_exclude_cache_parameters():
    blocks = _blocks()
    handle = apply_layerwise_offload(blocks, device="cpu", excluded_prefixes=EXCLUDED_OFFLOAD_PREFIXES)
    assert handle.transfer_bytes() == 3 * 16 * 4
    assert handle.excluded_bytes == 3 * (12 + 4) * 4
    handle.remove()


def test_move_excluded_counts_matching_parameters_only():
    blocks = _blocks(2)
    assert move_excluded(blocks, ("adaln_proj.linear.",), "cpu") == 2 * 16 * 4
    assert move_excluded(blocks, ("nothing.",), "cpu") == 0


def test_excluded_parameters_offloaded_by_the_cache_stay_offloaded():
    """The AdaLN cache may free its weights; the block hooks must never bring them back."""
    blocks = _blocks(2)
    handle = apply_layerwise_offload(blocks, device="cpu", excluded_prefixes=EXCLUDED_OFFLOAD_PREFIXES)
    blocks[1].adaln_proj.linear.weight.data = torch.empty(0)
    blocks[1].adaln_proj.linear.forward = lambda x: torch.zeros(x.shape[0], 4)
    _run(blocks, torch.randn(2, 4))
    assert blocks[1].adaln_proj.linear.weight.numel() == 0
    handle.remove()
    assert blocks[1].adaln_proj.linear.weight.numel() == 0


def test_model_offload_round_trip_and_exclusion():
    model = nn.Sequential(_blocks(2)[0], _blocks(2)[1])
    x = torch.randn(2, 4)
    reference = model(x)
    handle = apply_model_offload(model, device="cpu", excluded_prefixes=EXCLUDED_OFFLOAD_PREFIXES)
    assert all(model[i].weight.numel() == 0 for i in range(2))
    assert all(model[i].adaln_proj.linear.weight.numel() == 12 for i in range(2))  # matched at any depth
    torch.testing.assert_close(model(x), reference, rtol=0, atol=0)
    assert all(s == {"weight", "adaln_proj.linear.weight", "adaln_proj.linear.bias"} for s in model[0].seen)
    assert model[0].weight.numel() == 0  # back off the device after the forward
    assert materialize(model) and model[0].weight.numel() == 16
    handle.remove()
    assert not materialize(model)
    torch.testing.assert_close(model(x), reference, rtol=0, atol=0)


def test_needs_blocks_and_device():
    with pytest.raises(ValueError):
        apply_layerwise_offload([], device="cpu")
    with pytest.raises(ValueError):
        apply_layerwise_offload(_blocks())
