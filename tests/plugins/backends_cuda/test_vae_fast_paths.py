"""A VAE decoder's GroupNorm+SiLU and Wan RMSNorm+SiLU pairs on the cuda platform's fused kernels behind the
request gate (docs/contracts-status.md C7): the way a model plugin wires them (``options.platform.ops`` plus
``omnicore.plugin.install_fast_path``), gate off bit-exact, gate on within the decode tolerance, our kernel
actually called, the state dict unchanged."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _cuda_helpers import DEVICE, PLUGIN
from omnicore.plugin import fast_path_gate, install_fast_path
from omnicore.testing.plugin import add_to_host, isolated_host
from torch import nn


class WanRMSNorm(nn.Module):
    """The Wan VAE's channel RMS norm (``F.normalize`` over channels * sqrt(C) * gamma + bias)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = channels ** 0.5
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(channels, 1, 1, 1))
        self.bias = nn.Parameter(0.1 * torch.randn(channels, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma + self.bias


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.conv_in = nn.Conv3d(4, 16, 3, padding=1)
        self.norm1, self.act1 = WanRMSNorm(16), nn.SiLU()
        self.conv_mid = nn.Conv3d(16, 16, 1)
        self.norm2, self.act2 = nn.GroupNorm(4, 16, eps=1e-6), nn.SiLU()
        self.conv_out = nn.Conv3d(16, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.norm1(self.conv_in(z)))
        return self.conv_out(self.act2(self.norm2(self.conv_mid(h))))


def install(decoder: Decoder, ops) -> object:
    """What a model plugin does at load: fused norm+SiLU behind the VAE's gate, the SiLU after it a no-op."""
    gate = fast_path_gate(decoder)
    n1, n2 = decoder.norm1, decoder.norm2
    install_fast_path(n1, lambda x: ops.rms_norm_silu(x, n1.gamma, n1.bias, 1e-12, 1), gate)
    install_fast_path(n2, lambda x: ops.group_norm_silu(x, n2.num_groups, n2.weight, n2.bias, n2.eps), gate)
    for act in (decoder.act1, decoder.act2):
        install_fast_path(act, lambda x: x, gate)
    return gate


@torch.no_grad()
def test_the_decoder_runs_the_fused_kernels_only_under_the_gate(monkeypatch):
    from omni_backends_cuda import ops

    host = isolated_host()
    add_to_host(host, PLUGIN, "backends_cuda")
    calls: list[str] = []
    for name in ("rms_norm_silu", "group_norm_silu"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    table = host.platform_ops("cuda")
    decoder = Decoder().to(DEVICE)
    plain = copy.deepcopy(decoder)
    gate = install(decoder, table)
    assert decoder.state_dict().keys() == plain.state_dict().keys()
    z = torch.randn(1, 4, 2, 5, 6, device=DEVICE)
    assert torch.equal(decoder(z), plain(z)) and calls == []
    with gate(True):
        fast = decoder(z)
    assert calls == ["rms_norm_silu", "group_norm_silu"]
    torch.testing.assert_close(fast.cpu(), plain(z).cpu(), atol=5e-4, rtol=1e-4)  # Wan decode under the gate
    assert torch.equal(decoder(z), plain(z))  # off again: bit-exact
