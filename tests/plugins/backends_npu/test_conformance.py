"""AttentionBackendConformance for npu_varlen, npu_laser and npu_rainfusion, run on the CPU op seam (the cpu-platform
variants of ``_npu_helpers``), and checks of the declarations the plugin makes for the ``npu`` platform."""

from __future__ import annotations

import pytest
from _npu_helpers import OPS, PLUGIN
from omnicore.config import Settings
from omnicore.errors import UnsupportedFeature
from omnicore.specs import AttentionRequirement
from omnicore.testing import AttentionBackendConformance
from omnicore.testing.plugin import add_to_host, isolated_host

SEAM = "_npu_helpers:CpuSeamBackends"


class _OnTheCpuSeam(AttentionBackendConformance):
    plugin_module = SEAM
    plugin_name = "npu-cpu-seam"
    dtypes = ("float32",)
    head_dim = 32

    @pytest.fixture(autouse=True)
    def _fresh_calls(self):
        OPS.calls.clear()
        yield
        OPS.calls.clear()


class TestNpuVarlen(_OnTheCpuSeam):
    backend = "npu_varlen"


class TestNpuLaser(_OnTheCpuSeam):
    backend = "npu_laser"


class TestNpuRainfusion(_OnTheCpuSeam):
    backend = "npu_rainfusion"


def test_the_kit_reached_the_op_seam():
    """The conformance numerics above ran through the seam (not around it): packed non-causal calls land in the
    varlen op, causal ones in the masked op."""
    import torch
    from _npu_helpers import npu_varlen_on_cpu
    from omnicore.attention.metadata import AttentionMetadata

    OPS.calls.clear()
    q = torch.randn(8, 2, 32)
    npu_varlen_on_cpu(q, q, q, metadata=AttentionMetadata(cu_seqlens_q=(0, 5, 8), max_seqlen_q=5, max_seqlen_k=5,
                                                          valid_kv_length=5))
    npu_varlen_on_cpu(q, q, q, metadata=AttentionMetadata(cu_seqlens_q=(0, 2, 5, 8)))
    npu_varlen_on_cpu(q, q, q, metadata=AttentionMetadata(cu_seqlens_q=(0, 2, 5, 8), causal=True))
    assert [c.op for c in OPS.calls] == ["varlen_attention", "varlen_attention", "attention"]
    OPS.calls.clear()


def test_npu_declarations_and_selection():
    host = isolated_host()
    assert add_to_host(host, PLUGIN, "backends_npu").status == "loaded"
    specs = {name: host.attention_backends.get(name) for name in ("npu_varlen", "npu_laser", "npu_rainfusion")}
    for spec in specs.values():
        caps = spec.capabilities
        assert caps.platforms == ("npu",) and caps.packed_varlen and caps.packed_mask_free and caps.prefix_kv_slicing
        assert not caps.spans and "float32" not in caps.dtypes
    assert specs["npu_rainfusion"].capabilities.sparse and not specs["npu_varlen"].capabilities.sparse
    h3 = AttentionRequirement(platform="npu", dtype="bfloat16", head_dim=128, packed_varlen=True,
                              packed_mask_free=True)
    assert host.select_attention(h3).name == "npu_varlen"  # the platform's preference, no environment variable
    sparse = AttentionRequirement(platform="npu", dtype="bfloat16", head_dim=128, packed_varlen=True, sparse=True)
    assert host.select_attention(sparse).name == "npu_rainfusion"
    forced = isolated_host(Settings(attention_backend="npu_laser"))
    assert add_to_host(forced, PLUGIN, "backends_npu").status == "loaded"
    assert forced.select_attention(h3).name == "npu_laser"
    with pytest.raises(UnsupportedFeature, match="platform 'cpu' not in"):
        forced.select_attention(AttentionRequirement(platform="cpu", packed_varlen=True))
