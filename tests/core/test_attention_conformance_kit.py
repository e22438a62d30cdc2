"""The attention conformance kit catches backends that mishandle the packed metadata they declare support for:
ignoring ``valid_kv_length`` or spans, choking on a sparse plan, or aligning prefix-K/V causal attention top-left."""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

BACKENDS = """
import attrs
import torch
import torch.nn.functional as F
from omnicore import hookimpl
from omnicore.attention.reference import sdpa_attention
from omnicore.specs import AttentionBackendSpec, AttentionCapabilities

def ignores_valid(q, k, v, *, metadata=None, **kw):
    if metadata is not None and metadata.valid_kv_length is not None:
        metadata = attrs.evolve(metadata, valid_kv_length=None)
    return sdpa_attention(q, k, v, metadata=metadata, **kw)

def ignores_spans(q, k, v, *, metadata=None, **kw):
    if metadata is not None and metadata.spans is not None:
        metadata = attrs.evolve(metadata, spans=None)
    return sdpa_attention(q, k, v, metadata=metadata, **kw)

def rejects_plans(q, k, v, *, metadata=None, **kw):
    if metadata is not None and metadata.sparse_plan is not None:
        raise TypeError("unexpected sparse plan")
    return sdpa_attention(q, k, v, metadata=metadata, **kw)

def top_left_causal(q, k, v, *, metadata=None, causal=False, scale=None, attn_mask=None):
    if metadata is None:
        return sdpa_attention(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask)
    causal = causal or metadata.causal
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    cq, ck = metadata.cu_seqlens_q, metadata.cu_k
    for i in range(metadata.num_docs):
        a = q[cq[i]:cq[i + 1]].transpose(0, 1)
        b, c = (t[ck[i]:ck[i + 1]].transpose(0, 1) for t in (k, v))
        rep = a.shape[0] // b.shape[0]
        b, c = b.repeat_interleave(rep, 0), c.repeat_interleave(rep, 0)
        out[cq[i]:cq[i + 1]] = F.scaled_dot_product_attention(a, b, c, is_causal=causal, scale=scale).transpose(0, 1)
    return out

def _caps(**flags):
    return AttentionCapabilities(dtypes=("float32",), head_dims=(8, 64), packed_varlen=True, **flags)

@hookimpl
def omnicore_register_attention_backends(register):
    register(AttentionBackendSpec(name="ignores_valid", impl="plug_attn:ignores_valid",
                                  capabilities=_caps(prefix_kv_slicing=True)))
    register(AttentionBackendSpec(name="ignores_spans", impl="plug_attn:ignores_spans",
                                  capabilities=_caps(spans=True)))
    register(AttentionBackendSpec(name="rejects_plans", impl="plug_attn:rejects_plans", capabilities=_caps()))
    register(AttentionBackendSpec(name="top_left", impl="plug_attn:top_left_causal", capabilities=_caps()))
"""

TESTS = """
from omnicore.testing import AttentionBackendConformance

class Base(AttentionBackendConformance):
    plugin_module = "plug_attn"
    head_dim = 16

class TestIgnoresValid(Base):
    backend = "ignores_valid"

class TestIgnoresSpans(Base):
    backend = "ignores_spans"

class TestRejectsPlans(Base):
    backend = "rejects_plans"

class TestTopLeft(Base):
    backend = "top_left"
"""


@pytest.mark.slow  # an inner pytest session over four backends
def test_kit_catches_backends_that_ignore_what_they_declare(pytester):
    pytester.makepyfile(plug_attn=textwrap.dedent(BACKENDS), test_inner=textwrap.dedent(TESTS))
    pytester.syspathinsert()
    reprec = pytester.inline_run("-p", "no:cacheprovider", "-k",
                                 "valid_kv or spans or sparse_plan or packed_causal or packed_matches")
    outcomes: dict[str, str] = {}
    for rep in reprec.getreports("pytest_runtest_logreport"):
        if (rep.when == "call" or rep.outcome != "passed") and outcomes.get(rep.nodeid) in (None, "passed"):
            outcomes[rep.nodeid] = rep.outcome

    def failing(cls: str) -> set[str]:
        return {n.rsplit("::", 1)[1] for n, o in outcomes.items() if f"::{cls}::" in n and o == "failed"}

    assert failing("TestIgnoresValid") == {"test_valid_kv_length_matches_reference"}
    assert failing("TestIgnoresSpans") == {"test_spans_match_reference"}
    assert failing("TestRejectsPlans") == {"test_dense_backend_accepts_and_ignores_a_sparse_plan"}
    assert failing("TestTopLeft") == {"test_packed_causal_matches_reference"}  # the prefix-K/V document
    assert outcomes["test_inner.py::TestTopLeft::test_packed_matches_reference"] == "passed"
    assert outcomes["test_inner.py::TestIgnoresValid::test_spans_match_reference"] == "skipped"  # not declared
