"""Checks for platform op implementations (the kernel seam): :class:`PlatformOpConformance`.

A backend's kernel for a named op (``omnicore.ops``) is compared with the op's eager reference on the same inputs
over several shapes (odd sizes, broadcasting, partial RoPE, both norms ...) and dtypes. The check goes through the
platform's op table exactly as a model does (``platform.ops.<op>``), and also calls the kernel directly wherever its
``applies`` predicate accepts the inputs, so a kernel that is never selected is noticed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, ClassVar

import pytest

from ..ops.names import OP_NAMES
from ..plugin_host.host import PluginHost
from ..specs import OpSpec, resolve
from .plugin import add_loaded, isolated_host

if TYPE_CHECKING:
    import torch

#: default (atol, rtol) per dtype, kernel vs eager reference on the same inputs
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (2e-2, 2e-2),
}

Case = tuple[str, tuple[object, ...], dict[str, object]]


def op_cases(op: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> Iterator[Case]:
    """``(label, args, kwargs)`` inputs for op ``op``: several shapes, broadcasting, optional arguments."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def t(*shape: int, dt: torch.dtype = dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    f32 = torch.float32
    if op == "rms_norm":
        yield "2d+weight", (t(33, 64), t(64, dt=f32), 1e-6), {}
        yield "3d+no-weight", (t(2, 7, 128), None, 1e-5), {}
        yield "4d-heads+weight", (t(2, 5, 3, 96), t(96, dt=f32), 1e-6), {}
    elif op == "modulate":
        yield "per-sample", (t(2, 17, 64), t(2, 1, 64, dt=f32), t(2, 1, 64, dt=f32, scale=0.1)), {}
        yield "vector", (t(33, 128), t(128), t(128, scale=0.1)), {}
    elif op == "gated_residual":
        yield "per-sample", (t(2, 17, 64), t(2, 17, 64), t(2, 1, 64)), {}
        yield "vector", (t(33, 128), t(33, 128), t(128)), {}
    elif op == "gated_residual_norm_modulate":
        for norm in ("layer", "rms"):
            yield f"{norm}", (t(2, 17, 64), t(2, 17, 64), t(2, 1, 64), t(2, 1, 64), t(2, 1, 64, scale=0.1), 1e-6), {
                "norm": norm}
            yield f"{norm}+weight", (t(33, 96), t(33, 96), t(96), t(96), t(96, scale=0.1), 1e-5), {
                "norm": norm, "weight": t(96, dt=f32)}
    elif op == "rope_rotate_half":
        cos, sin = t(9, 1, 64, dt=f32), t(9, 1, 64, dt=f32)
        yield "full", (t(2, 9, 4, 64), cos, sin), {}
        yield "partial", (t(9, 4, 64), t(9, 1, 32, dt=f32), t(9, 1, 32, dt=f32)), {}
        yield "same-dtype", (t(3, 11, 2, 40), t(11, 1, 40), t(11, 1, 40)), {}
    elif op == "group_norm_silu":
        yield "2d-image", (t(2, 32, 5, 6), 8, t(32), t(32), 1e-6), {}
        yield "3d-video", (t(1, 64, 3, 4, 4), 32, t(64), t(64), 1e-5), {}
        yield "no-affine", (t(2, 16, 7), 4, None, None, 1e-6), {}
    elif op == "rms_norm_silu":
        yield "channel-first", (t(2, 16, 3, 4, 4), t(16, 1, 1, 1), t(16, 1, 1, 1), 1e-12), {"channel_dim": 1}
        yield "no-bias", (t(1, 24, 5, 6), t(24, 1, 1), None), {}
        yield "channel-last", (t(2, 7, 32), t(32), 0.0), {"channel_dim": -1}
    elif op == "swiglu":
        yield "3d", (t(2, 17, 96), t(2, 17, 96)), {}
        yield "2d", (t(33, 128), t(33, 128)), {}
    elif op == "upsample2x_conv":
        yield "bias", (t(2, 8, 5, 6), t(12, 8, 3, 3, scale=0.2), t(12)), {}
        yield "no-bias", (t(1, 16, 4, 3), t(16, 16, 3, 3, scale=0.2), None), {}
        yield "odd-channels", (t(1, 5, 3, 7), t(3, 5, 3, 3, scale=0.2), t(3)), {"padding": 1}
    elif op == "lora_segment_delta":
        def ends(*values: int) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        # equal segments (a batched layout), ragged ones (packed documents, an empty one), mixed ranks zero-padded
        yield "equal-segments", (t(4 * 9, 64), t(4, 8, 64, scale=0.1), t(4, 48, 8, scale=0.1), ends(9, 18, 27, 36)), {}
        a, b = t(3, 12, 40, scale=0.1), t(3, 72, 12, scale=0.1)
        a[1, 4:] = 0
        b[1, :, 4:] = 0
        b[2] = 0  # a segment without adapters
        yield "ragged+padded-ranks", (t(37, 40), a, b, ends(13, 13, 37)), {}
        yield "one-segment", (t(5, 16), t(1, 4, 16, scale=0.1), t(1, 24, 4, scale=0.1), ends(5)), {}
    else:
        raise KeyError(f"no cases for op {op!r}")


class PlatformOpConformance:
    """Conformance checks for one op on one platform, as registered by a backend plugin.

    Attributes to set:
      ``op``: the op name (one of ``omnicore.ops.OP_NAMES``). Required.
      ``platform``: the platform the implementation is registered for. Required.
      ``plugin_module`` / ``plugin_name``: the plugin registering it (entry-point target, e.g. ``pkg.plugin``).
      ``device``: where tensors are made (default ``"cpu"``).
      ``dtypes``: dtypes to check (default float32 and bfloat16).
      ``tolerances``: ``{dtype: (atol, rtol)}`` overrides of :data:`TOLERANCES`.
      ``require_applies``: fail when ``applies`` rejects every case (default True: an untested kernel is a bug).
    Override :meth:`cases` to add shapes.
    """

    op: str = ""
    platform: str = ""
    plugin_module: str | None = None
    plugin_name: str | None = None
    device: str = "cpu"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    tolerances: ClassVar[dict[str, tuple[float, float]]] = {}
    require_applies: bool = True

    # ------------------------------------------------------------------ fixtures and helpers
    @pytest.fixture
    def ops_host(self) -> PluginHost:
        if self.op not in OP_NAMES or not self.platform:
            pytest.fail(f"{type(self).__name__}: set `op` (one of {', '.join(OP_NAMES)}) and `platform`")
        host = isolated_host()
        if self.plugin_module:
            add_loaded(host, self.plugin_module, self.plugin_name)
        return host

    @pytest.fixture
    def op_specs(self, ops_host: PluginHost) -> tuple[OpSpec, ...]:
        specs = ops_host.platform_ops(self.platform).implementations(self.op)
        assert specs, f"no implementation of op {self.op!r} is registered for platform {self.platform!r}"
        return specs

    def cases(self, dtype: torch.dtype) -> list[Case]:
        """The inputs checked for ``dtype`` (override to add model-specific shapes)."""
        return list(op_cases(self.op, dtype, self.device))

    def _close(self, got: object, want: object, dtype: str, what: str) -> None:
        import torch

        if isinstance(want, tuple):
            assert isinstance(got, tuple) and len(got) == len(want), f"{what}: returns {type(got)}, expected a tuple"
            for i, (g, w) in enumerate(zip(got, want)):
                self._close(g, w, dtype, f"{what}[{i}]")
            return
        atol, rtol = {**TOLERANCES, **self.tolerances}.get(dtype, (5e-2, 5e-2))
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), (
            f"{what}: returns {type(got)}, reference {type(want)}")
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != reference {want.dtype}"
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{what}: {m}")

    def _eager(self) -> Callable[..., object]:
        from ..ops.table import PlatformOps

        return PlatformOps.eager(self.op)

    # ------------------------------------------------------------------ checks
    def test_registration_is_well_formed(self, op_specs: tuple[OpSpec, ...]) -> None:
        for spec in op_specs:
            assert callable(resolve(spec.impl)), f"{spec.impl!r} is not callable"
            if spec.applies is not None:
                assert callable(resolve(spec.applies)), f"{spec.applies!r} is not callable"
            assert isinstance(spec.priority, int)

    def test_table_matches_eager_reference(self, ops_host: PluginHost, op_specs: tuple[OpSpec, ...]) -> None:
        """Through ``platform.ops`` (what models call): equal to the reference within the dtype's tolerance."""
        import torch

        table_op = getattr(ops_host.platform_ops(self.platform), self.op)
        eager = self._eager()
        for dtype in self.dtypes:
            for label, args, kwargs in self.cases(getattr(torch, dtype)):
                self._close(table_op(*args, **kwargs), eager(*args, **kwargs), dtype, f"{self.op} {label} {dtype}")

    def test_each_kernel_matches_where_it_applies(self, op_specs: tuple[OpSpec, ...]) -> None:
        """Each implementation called directly on every case its ``applies`` accepts; ``applies`` answers a bool."""
        import torch

        eager = self._eager()
        for spec in op_specs:
            impl = resolve(spec.impl)
            applies = resolve(spec.applies) if spec.applies else None
            accepted = 0
            for dtype in self.dtypes:
                for label, args, kwargs in self.cases(getattr(torch, dtype)):
                    if applies is not None:
                        verdict = applies(*args, **kwargs)
                        assert isinstance(verdict, bool), (
                            f"{spec.applies}({label}, {dtype}) returned {type(verdict).__name__}, not bool "
                            "(a tensor would synchronise the device)")
                        if not verdict:
                            continue
                    accepted += 1
                    self._close(impl(*args, **kwargs), eager(*args, **kwargs), dtype,
                                f"{spec.provider}:{self.op} {label} {dtype}")
            if self.require_applies:
                assert accepted, (f"{spec.applies} rejected every case on {self.device} for dtypes {self.dtypes}: the "
                                  "kernel was never checked (set `device`/`dtypes`, override `cases`, or set "
                                  "require_applies = False)")
