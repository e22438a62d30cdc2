"""The kernel seam: eager op references, per-platform op tables with ``applies`` fallback, the registration hook,
a model calling ops through its platform, and ``omnicore plugins`` listing which ops a backend provides."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from omnicore.errors import PluginError
from omnicore.hookspecs import hookimpl
from omnicore.ops import OP_NAMES
from omnicore.ops import reference as ref
from omnicore.platforms.cpu import CpuPlatform
from omnicore.specs import OpSpec
from omnicore.testing.plugin import add_to_host, isolated_host
from toy import ops_backend

pytest_plugins = ["pytester"]


def g(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------------- eager references


def test_rms_norm_reference_is_fp32_and_casts_back():
    x, w = g(3, 5, 16, dtype=torch.bfloat16), g(16, seed=1)
    want = (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())
    out = ref.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want.to(torch.bfloat16).double(), atol=0, rtol=0)
    torch.testing.assert_close(ref.rms_norm(x.float(), None, 1e-6).double(),
                               x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6))


def test_modulate_and_gated_residual_broadcast():
    x, shift, scale, gate = g(2, 7, 8), g(2, 1, 8, seed=1), g(2, 1, 8, seed=2), g(8, seed=3)
    torch.testing.assert_close(ref.modulate(x, shift, scale), x * (1 + scale) + shift)
    torch.testing.assert_close(ref.gated_residual(x, shift.expand(2, 7, 8), gate), x + gate * shift)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gated_residual_norm_modulate_returns_stream_and_modulated(norm):
    res, upd, gate, shift, scale, w = (g(2, 5, 12, seed=s) for s in range(6))
    h, m = ref.gated_residual_norm_modulate(res, upd, gate, shift, scale, 1e-6, norm=norm, weight=w[0, 0])
    torch.testing.assert_close(h, res + gate * upd)
    if norm == "layer":
        n = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-6) * w[0, 0]
    else:
        n = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w[0, 0]
    torch.testing.assert_close(m, n * (1 + scale) + shift, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="norm must be one of"):
        ref.gated_residual_norm_modulate(res, upd, gate, shift, scale, 1e-6, norm="group")


def test_rope_rotate_half_full_and_partial():
    x = g(5, 2, 8)
    angles = g(5, 1, 2, seed=1)  # R = 4 -> 2 frequencies
    cos, sin = torch.cos(angles).repeat(1, 1, 2), torch.sin(angles).repeat(1, 1, 2)
    out = ref.rope_rotate_half(x, cos, sin)
    # pairs (x[i], x[i + R/2]) rotate as complex numbers by the angle; dims R.. pass through
    for i in range(2):
        a, b = x[..., i], x[..., i + 2]
        c, s = torch.cos(angles[..., i]), torch.sin(angles[..., i])
        torch.testing.assert_close(out[..., i], a * c - b * s)
        torch.testing.assert_close(out[..., i + 2], b * c + a * s)
    assert torch.equal(out[..., 4:], x[..., 4:])
    with pytest.raises(ValueError, match="must be even"):
        ref.rope_rotate_half(x, cos[..., :3], sin[..., :3])


def test_norm_silu_ops_and_swiglu():
    x, w, b = g(2, 8, 3, 3), g(8, seed=1), g(8, seed=2)
    torch.testing.assert_close(ref.group_norm_silu(x, 4, w, b, 1e-6), F.silu(F.group_norm(x, 4, w, b, 1e-6)))
    gamma, bias = g(8, 1, 1, seed=3), g(8, 1, 1, seed=4)
    norm = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    torch.testing.assert_close(ref.rms_norm_silu(x, gamma, bias), F.silu(norm * math.sqrt(8) * gamma + bias))
    torch.testing.assert_close(ref.rms_norm_silu(x, gamma, None), F.silu(norm * math.sqrt(8) * gamma))
    a, u = g(4, 6), g(4, 6, seed=1)
    torch.testing.assert_close(ref.swiglu(a, u), a * torch.sigmoid(a) * u)


def test_every_op_name_has_a_reference_and_importing_ops_is_torch_free():
    assert all(callable(getattr(ref, n)) for n in OP_NAMES)
    code = "import sys, omnicore.ops, omnicore.specs; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


# ----------------------------------------------------------------------------------- registration and tables


def test_op_spec_validates_names():
    with pytest.raises(ValueError, match="unknown op 'layer_norm'"):
        OpSpec(name="layer_norm", platform="cpu", impl="m:f")
    with pytest.raises(ValueError, match="lazy 'module:attr' path"):
        OpSpec(name="swiglu", platform="cpu", impl="not a path")


def test_unbound_platform_runs_eager_references():
    plat = CpuPlatform()
    assert plat.ops.rms_norm is ref.rms_norm and plat.ops.swiglu is ref.swiglu
    with pytest.raises(AttributeError, match="does not exist"):
        plat.ops.flash_everything  # noqa: B018


def test_registered_op_is_used_where_it_applies_and_falls_back_elsewhere():
    host = isolated_host()
    record = add_to_host(host, "toy.ops_backend:ToyOpsBackend", "toy-ops")
    assert record.status == "loaded", record.error
    assert record.hooks == ["omnicore_register_ops"]
    assert [host.ops.get(k).name for k in record.registered["op"]] == ["rms_norm", "swiglu"]
    table = host.platform_ops("cpu")
    assert table.provided() == {"rms_norm": ["toy-ops"], "swiglu": ["toy-ops"]}
    assert host.platform_ops("cuda").provided() == {}  # registered for cpu only
    ops_backend.CALLS.clear()
    x, w = g(6, 32), g(32, seed=1)
    torch.testing.assert_close(table.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    heads = g(6, 2, 32)  # 3-D: not applicable -> eager
    assert torch.equal(table.rms_norm(heads, w, 1e-6), ref.rms_norm(heads, w, 1e-6))
    assert ops_backend.CALLS == {"rms_norm.applies": 1, "rms_norm.fast": 1, "rms_norm.fallback": 1}
    assert table.modulate is ref.modulate  # nobody registered it


def test_priority_orders_implementations_and_a_broken_impl_names_its_plugin(make_module):
    low = make_module("def rms(x, w, eps):\n    return 'low'\n")
    high = make_module("def rms(x, w, eps):\n    return 'high'\n\ndef only_big(x, w, eps):\n    return x > 10\n")

    class Two:
        @hookimpl
        def omnicore_register_ops(self, register):
            register(OpSpec(name="rms_norm", platform="cpu", impl=f"{low}:rms", priority=1))

    class One:
        @hookimpl
        def omnicore_register_ops(self, register):
            register(OpSpec(name="rms_norm", platform="cpu", impl=f"{high}:rms", applies=f"{high}:only_big",
                            priority=5))
            register(OpSpec(name="swiglu", platform="cpu", impl=f"{high}:missing"))

    host = isolated_host()
    host.add_plugin(Two(), "two")
    host.add_plugin(One(), "one")
    table = host.platform_ops("cpu")
    assert [s.provider for s in table.implementations("rms_norm")] == ["one", "two"]
    assert table.rms_norm(20, None, 0.0) == "high" and table.rms_norm(3, None, 0.0) == "low"
    with pytest.raises(PluginError, match="one.*swiglu.*missing"):
        table.swiglu  # noqa: B018


def test_a_second_registration_by_one_plugin_is_a_duplicate():
    class Twice:
        @hookimpl
        def omnicore_register_ops(self, register):
            for _ in range(2):
                register(OpSpec(name="swiglu", platform="cpu", impl="toy.ops_backend:swiglu"))

    host = isolated_host()
    record = host.add_plugin(Twice(), "twice")
    assert record.status == "failed" and "swiglu@cpu:twice" in record.error
    assert len(host.ops) == 0  # nothing of a failed plugin stays registered


def test_engine_binds_the_host_op_table_to_its_platform(toy_settings):
    from omnicore.engine.api import Engine
    from toy.plugin import ToyPlugin

    host = isolated_host(toy_settings)
    host.add_plugin(ToyPlugin(), "toy")
    add_to_host(host, "toy.ops_backend:ToyOpsBackend", "toy-ops")
    with Engine("tiny:toy", host=host, settings=toy_settings) as engine:
        assert engine.platform.ops.provided() == {"rms_norm": ["toy-ops"], "swiglu": ["toy-ops"]}
        assert engine.platform.ops.__dict__["swiglu"] is ops_backend.swiglu  # imported at start-up

    class Broken:
        @hookimpl
        def omnicore_register_ops(self, register):
            register(OpSpec(name="modulate", platform="cpu", impl="toy.ops_backend:no_such_kernel"))

    host.add_plugin(Broken(), "broken-ops")
    with pytest.raises(PluginError, match="broken-ops.*'modulate'.*no_such_kernel"):
        Engine("tiny:toy", host=host, settings=toy_settings)  # at start-up, before any weight is read


# ----------------------------------------------------------------------------------- conformance kit


# (the kit passing real toy kernels: tests/core/test_testing_kit.py, TestToy*OpConforms)


WRONG_OPS = {
    "plug_wrong_ops": """
        from omnicore import hookimpl
        from omnicore.specs import OpSpec

        def sloppy_swiglu(gate, up):
            import torch
            return torch.relu(gate) * up          # wrong activation

        def never(gate, up):
            return False

        def tensor_applies(gate, up):
            return gate.sum() > -1e9             # a tensor, not a bool

        @hookimpl
        def omnicore_register_ops(register):
            register(OpSpec(name="swiglu", platform="cpu", impl="plug_wrong_ops:sloppy_swiglu"))
            register(OpSpec(name="swiglu", platform="toyplat", impl="plug_wrong_ops:sloppy_swiglu",
                            applies="plug_wrong_ops:never"))
            register(OpSpec(name="swiglu", platform="tensorplat", impl="plug_wrong_ops:sloppy_swiglu",
                            applies="plug_wrong_ops:tensor_applies"))
    """,
}

WRONG_OPS_TESTS = """
    from omnicore.testing import PlatformOpConformance

    class TestWrong(PlatformOpConformance):
        op = "swiglu"
        platform = "cpu"
        plugin_module = "plug_wrong_ops"

    class TestNeverApplies(PlatformOpConformance):
        op = "swiglu"
        platform = "toyplat"
        plugin_module = "plug_wrong_ops"

    class TestTensorApplies(PlatformOpConformance):
        op = "swiglu"
        platform = "tensorplat"
        plugin_module = "plug_wrong_ops"

    class TestMissing(PlatformOpConformance):
        op = "rms_norm"
        platform = "cpu"
        plugin_module = "plug_wrong_ops"
"""


@pytest.mark.slow  # an inner pytest session
def test_op_conformance_catches_wrong_unchecked_and_missing_kernels(pytester):
    for name, source in WRONG_OPS.items():
        pytester.makepyfile(**{name: textwrap.dedent(source)})
    pytester.makepyfile(test_inner=textwrap.dedent(WRONG_OPS_TESTS))
    pytester.syspathinsert()
    reprec = pytester.inline_run("-p", "no:cacheprovider")
    out: dict[str, str] = {}
    for rep in reprec.getreports("pytest_runtest_logreport"):  # the worst phase outcome wins
        if (rep.when == "call" or rep.outcome != "passed") and out.get(rep.nodeid) in (None, "passed"):
            out[rep.nodeid] = rep.outcome

    def failing(outcomes: dict[str, str], cls: str) -> set[str]:
        return {n.rsplit("::", 1)[1] for n, o in outcomes.items() if n.startswith(cls + "::") and o == "failed"}

    assert failing(out, "test_inner.py::TestWrong") == {"test_table_matches_eager_reference",
                                                         "test_each_kernel_matches_where_it_applies"}
    # never applicable: the table falls back (passes) but the kernel itself was never checked (fails)
    assert failing(out, "test_inner.py::TestNeverApplies") == {"test_each_kernel_matches_where_it_applies"}
    assert "test_each_kernel_matches_where_it_applies" in failing(out, "test_inner.py::TestTensorApplies")
    assert failing(out, "test_inner.py::TestMissing") == {
        "test_registration_is_well_formed", "test_table_matches_eager_reference",
        "test_each_kernel_matches_where_it_applies"}


# ----------------------------------------------------------------------------------- omnicore plugins


def test_plugins_cli_lists_ops_and_platform_availability(tmp_path):
    """A backend distribution registering a platform that is unavailable here and two ops for it."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    info = pkg / "omnitest_fastops-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omnitest-fastops\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[omnicore]\nfastops = omnitest_fastops\n")
    (pkg / "omnitest_fastops.py").write_text(
        "from omnicore import hookimpl\n"
        "from omnicore.specs import OpSpec, PlatformSpec\n"
        "def probe():\n    return 'no fastdev driver (libfast.so not found)'\n"
        "@hookimpl\n"
        "def omnicore_register_platforms(register):\n"
        "    register(PlatformSpec(name='fastdev', impl='omnicore.platforms.cpu:CpuPlatform', priority=50,\n"
        "                          probe='omnitest_fastops:probe'))\n"
        "@hookimpl\n"
        "def omnicore_register_ops(register):\n"
        "    for op in ('rms_norm', 'swiglu'):\n"
        "        register(OpSpec(name=op, platform='fastdev', impl='omnitest_fastops:probe'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    env.update(PYTHONPATH=str(pkg), OMNICORE_PLUGINS="fastops")
    cmd = [sys.executable, "-m", "omnicore.cli.main", "plugins"]
    payload = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env,
                                        check=True).stdout)
    platforms = {p["name"]: p for p in payload["platforms"]}
    assert platforms["fastdev"]["available"] is False
    assert platforms["fastdev"]["reason"] == "no fastdev driver (libfast.so not found)"
    assert platforms["fastdev"]["ops"] == {"rms_norm": ["fastops"], "swiglu": ["fastops"]}
    assert platforms["cpu"] == {**platforms["cpu"], "available": True, "reason": None, "ops": {}}
    assert sorted(payload["registries"]["op"]) == ["rms_norm@fastdev:fastops", "swiglu@fastdev:fastops"]
    table = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    assert "op: rms_norm@fastdev, swiglu@fastdev" in table
    row = next(line for line in table.splitlines() if line.startswith("fastdev "))
    assert "no: no fastdev driver (libfast.so not found)" in row and "rms_norm (fastops)" in row


def test_plugin_conformance_checks_op_registrations():
    """``PluginConformance`` knows the op registry: ``plugin_info`` may declare ops; ``applies`` paths must resolve."""
    from omnicore.testing.plugin import declared_registrations, lazy_paths

    spec = OpSpec(name="swiglu", platform="cpu", impl="toy.ops_backend:swiglu", applies="toy.ops_backend:nope")
    assert dict(lazy_paths(spec)) == {"impl": "toy.ops_backend:swiglu", "applies": "toy.ops_backend:nope"}
    assert declared_registrations({"ops": ["swiglu@cpu:x"]}) == {"op": ["swiglu@cpu:x"]}


@pytest.mark.parametrize("op", OP_NAMES)
def test_conformance_cases_exist_and_run_for_every_op(op):
    """The kit's inputs are valid for every op and dtype (backend plugins rely on them)."""
    from omnicore.testing.ops import op_cases

    for dtype in (torch.float32, torch.bfloat16):
        cases = list(op_cases(op, dtype, "cpu"))
        assert len(cases) >= 2
        for label, args, kwargs in cases:
            out = getattr(ref, op)(*args, **kwargs)
            for t in out if isinstance(out, tuple) else (out,):
                assert bool(torch.isfinite(t).all()), f"{op} {label} {dtype}"
