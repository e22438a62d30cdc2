"""Checks for attention backends: :class:`AttentionBackendConformance`.

Every backend is compared with the core's CPU reference (:func:`omnicore.attention.reference.sdpa_attention`,
run in float32 on the same inputs) and must honour what its :class:`AttentionCapabilities` declare. Packed calls
carry an :class:`~omnicore.attention.metadata.AttentionMetadata` (``metadata=``): documents, GQA, prefix K/V,
causal, ``valid_kv_length`` (``prefix_kv_slicing``), bidirectional spans (``spans``) and a sparse plan that a
dense backend must accept and ignore.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from ..config import Settings
from ..errors import UnsupportedFeature
from ..plugin_host.host import PluginHost
from ..specs import AttentionBackendSpec, AttentionRequirement
from .plugin import add_loaded, isolated_host

if TYPE_CHECKING:
    import torch

    from ..attention.metadata import AttentionMetadata
    from ..attention.packed import PackedSequence

#: An attention backend's implementation: ``fn(q, k, v, **options) -> out``.
AttentionFn = Callable[..., "torch.Tensor"]

#: default (atol, rtol) per dtype against the float32 reference
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (2e-4, 2e-4),
    "float16": (5e-3, 5e-3),
    "bfloat16": (3e-2, 3e-2),
}


class AttentionBackendConformance:
    """Conformance checks for one registered attention backend.

    Attributes to set:
      ``backend``: the registered backend name. Required.
      ``plugin_module``: entry-point target of the plugin registering it (``None`` for core built-ins).
      ``platform`` / ``device``: where the checks run (default ``"cpu"`` / ``"cpu"``).
      ``dtypes``: dtypes to check (default: every declared dtype).
      ``head_dim``: head dim to test with (clamped into the declared range).
      ``supports_gqa``: the backend accepts fewer key/value heads than query heads.
      ``supports_causal``: the backend honours ``causal`` (dense keyword and ``metadata.causal``).
      ``tolerances``: ``{dtype: (atol, rtol)}`` overrides of :data:`TOLERANCES`.
    """

    backend: str = ""
    plugin_module: str | None = None
    plugin_name: str | None = None
    platform: str = "cpu"
    device: str = "cpu"
    dtypes: tuple[str, ...] | None = None
    head_dim: int = 64
    supports_gqa: bool = True
    supports_causal: bool = True
    tolerances: ClassVar[dict[str, tuple[float, float]]] = {}

    # ------------------------------------------------------------------ fixtures and helpers
    def _build_host(self, settings: Settings | None = None) -> PluginHost:
        if not self.backend:
            pytest.fail(f"{type(self).__name__}: set `backend` to the registered backend name")
        host = isolated_host(settings)
        if self.plugin_module:
            add_loaded(host, self.plugin_module, self.plugin_name)
        return host

    @pytest.fixture
    def attention_host(self) -> PluginHost:
        return self._build_host()

    @pytest.fixture
    def backend_spec(self, attention_host: PluginHost) -> AttentionBackendSpec:
        return attention_host.attention_backends.get(self.backend)

    @pytest.fixture
    def attention_fn(self, backend_spec: AttentionBackendSpec) -> AttentionFn:
        return backend_spec.load_impl()

    def _dtypes(self, spec: AttentionBackendSpec) -> list[str]:
        return list(self.dtypes if self.dtypes is not None else spec.capabilities.dtypes)

    def _head_dim(self, spec: AttentionBackendSpec) -> int:
        lo, hi = spec.capabilities.head_dims
        return min(max(self.head_dim, lo), hi)

    def _rand(self, *shape: int, seed: int, dtype: str = "float32") -> torch.Tensor:
        import torch

        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g).to(device=self.device, dtype=getattr(torch, dtype))

    def _check_close(self, got: torch.Tensor, want: torch.Tensor, dtype: str, what: str) -> None:
        import torch

        atol, rtol = {**TOLERANCES, **self.tolerances}.get(dtype, (5e-2, 5e-2))
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{what}: {m}")

    @staticmethod
    def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        from ..attention.reference import sdpa_attention

        return sdpa_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                              **{n: (t.cpu() if hasattr(t, "cpu") else t) for n, t in kwargs.items()})

    # ------------------------------------------------------------------ declarations
    def test_capabilities_are_well_formed(self, backend_spec: AttentionBackendSpec) -> None:
        import torch

        caps = backend_spec.capabilities
        lo, hi = caps.head_dims
        assert 1 <= lo <= hi, f"head_dims must be an inclusive range [lo, hi] with 1 <= lo <= hi, got {caps.head_dims}"
        assert caps.platforms, "declare at least one platform"
        assert caps.dtypes, "declare at least one dtype"
        for name in caps.dtypes:
            assert isinstance(getattr(torch, name, None), torch.dtype), f"declared dtype {name!r} is not a torch dtype"
        assert self.platform in caps.platforms, (
            f"the checks run on platform {self.platform!r}, which {backend_spec.name!r} does not declare "
            f"({list(caps.platforms)}); set `platform`/`device` to one it supports")

    def test_selection_honours_the_declaration(self, backend_spec: AttentionBackendSpec) -> None:
        caps = backend_spec.capabilities
        hi = caps.head_dims[1]
        fits = AttentionRequirement(platform=self.platform, dtype=caps.dtypes[0], head_dim=self._head_dim(backend_spec),
                                    packed_varlen=caps.packed_varlen, packed_mask_free=caps.packed_mask_free,
                                    sparse=caps.sparse, prefix_kv_slicing=caps.prefix_kv_slicing, spans=caps.spans)
        assert fits.unmet_by(caps) == []
        beyond = AttentionRequirement(platform=self.platform, dtype=caps.dtypes[0], head_dim=hi + 1)
        forced = self._build_host(Settings(attention_backend=backend_spec.name))
        assert forced.select_attention(fits).name == backend_spec.name
        with pytest.raises(UnsupportedFeature, match=re.escape(repr(backend_spec.name))):
            forced.select_attention(beyond)

    # ------------------------------------------------------------------ numerics
    def test_dense_matches_reference(self, backend_spec: AttentionBackendSpec, attention_fn: AttentionFn) -> None:
        d = self._head_dim(backend_spec)
        for dtype in self._dtypes(backend_spec):
            q, k, v = (self._rand(2, 37, 4, d, seed=s, dtype=dtype) for s in (1, 2, 3))
            out = attention_fn(q, k, v)
            assert out.dtype == q.dtype, f"{dtype}: output dtype {out.dtype} differs from the input's"
            self._check_close(out, self._reference(q, k, v), dtype, f"dense {dtype}")

    def test_dense_gqa_matches_reference(self, backend_spec: AttentionBackendSpec, attention_fn: AttentionFn) -> None:
        if not self.supports_gqa:
            pytest.skip("backend declares no grouped-query attention (supports_gqa = False)")
        d = self._head_dim(backend_spec)
        dtype = self._dtypes(backend_spec)[0]
        q = self._rand(1, 19, 8, d, seed=4, dtype=dtype)
        k, v = (self._rand(1, 23, 2, d, seed=s, dtype=dtype) for s in (5, 6))
        self._check_close(attention_fn(q, k, v), self._reference(q, k, v), dtype, f"GQA {dtype}")

    def test_dense_causal_matches_reference(self, backend_spec: AttentionBackendSpec,
                                            attention_fn: AttentionFn) -> None:
        if not self.supports_causal:
            pytest.skip("backend declares no causal attention (supports_causal = False)")
        d = self._head_dim(backend_spec)
        dtype = self._dtypes(backend_spec)[0]
        q, k, v = (self._rand(2, 21, 4, d, seed=s, dtype=dtype) for s in (7, 8, 9))
        self._check_close(attention_fn(q, k, v, causal=True), self._reference(q, k, v, causal=True), dtype,
                          f"dense causal {dtype}")

    def _packed_inputs(self, spec: AttentionBackendSpec, dtype: str, seed: int = 10,
                       heads: int = 4, kv_heads: int = 4,
                       ) -> tuple[PackedSequence, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        from ..attention.metadata import AttentionMetadata
        from ..attention.packed import PackedSequence

        ps = PackedSequence.from_lengths([1, 9, 16, 3], pad_to_multiple=8)  # 29 real rows -> 32
        d = self._head_dim(spec)
        q = self._rand(ps.padded_length, heads, d, seed=seed, dtype=dtype)
        k, v = (self._rand(ps.padded_length, kv_heads, d, seed=seed + i, dtype=dtype) for i in (1, 2))
        return ps, q, k, v, AttentionMetadata.from_packed(ps)

    def _require(self, spec: AttentionBackendSpec, *flags: str) -> None:
        for flag in flags:
            if not getattr(spec.capabilities, flag):
                pytest.skip(f"{spec.name!r} does not declare {flag}")

    def _require_packed(self, spec: AttentionBackendSpec) -> None:
        self._require(spec, "packed_varlen")

    def test_packed_matches_reference(self, backend_spec: AttentionBackendSpec, attention_fn: AttentionFn) -> None:
        self._require_packed(backend_spec)
        for dtype in self._dtypes(backend_spec):
            ps, q, k, v, md = self._packed_inputs(backend_spec, dtype)
            out = attention_fn(q, k, v, metadata=md)
            n = ps.valid_length
            self._check_close(out[:n], self._reference(q, k, v, metadata=md)[:n], dtype, f"packed {dtype}")

    def test_packed_gqa_matches_reference(self, backend_spec: AttentionBackendSpec, attention_fn: AttentionFn) -> None:
        self._require_packed(backend_spec)
        if not self.supports_gqa:
            pytest.skip("backend declares no grouped-query attention (supports_gqa = False)")
        dtype = self._dtypes(backend_spec)[0]
        ps, q, k, v, md = self._packed_inputs(backend_spec, dtype, seed=40, heads=8, kv_heads=2)
        n = ps.valid_length
        self._check_close(attention_fn(q, k, v, metadata=md)[:n], self._reference(q, k, v, metadata=md)[:n],
                          dtype, f"packed GQA {dtype}")

    def test_packed_cross_attention_matches_reference(self, backend_spec: AttentionBackendSpec,
                                                      attention_fn: AttentionFn) -> None:
        """Documents with more keys than queries (a prefix K/V, or cross-attention) and one with fewer."""
        self._require_packed(backend_spec)
        from ..attention.metadata import AttentionMetadata

        dtype = self._dtypes(backend_spec)[0]
        d = self._head_dim(backend_spec)
        md = AttentionMetadata(cu_seqlens_q=(0, 3, 11, 12), cu_seqlens_k=(0, 7, 9, 20))
        q = self._rand(12, 4, d, seed=20, dtype=dtype)
        k, v = (self._rand(20, 4, d, seed=s, dtype=dtype) for s in (21, 22))
        out = attention_fn(q, k, v, metadata=md)
        self._check_close(out, self._reference(q, k, v, metadata=md), dtype, f"packed cross-attention {dtype}")

    def test_packed_causal_matches_reference(self, backend_spec: AttentionBackendSpec,
                                             attention_fn: AttentionFn) -> None:
        """Causal documents, including prefix K/V documents (queries are the last positions: bottom-right)."""
        self._require_packed(backend_spec)
        if not self.supports_causal:
            pytest.skip("backend declares no causal attention (supports_causal = False)")
        from ..attention.metadata import AttentionMetadata

        dtype = self._dtypes(backend_spec)[0]
        d = self._head_dim(backend_spec)
        for cu_q, cu_k in (((0, 5, 17), None), ((0, 4, 10), (0, 9, 16))):
            md = AttentionMetadata(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
            q = self._rand(md.total_q, 4, d, seed=23, dtype=dtype)
            k, v = (self._rand(md.total_k, 4, d, seed=s, dtype=dtype) for s in (24, 25))
            self._check_close(attention_fn(q, k, v, metadata=md), self._reference(q, k, v, metadata=md), dtype,
                              f"packed causal {dtype} cu_q={cu_q} cu_k={cu_k}")

    def test_valid_kv_length_matches_reference(self, backend_spec: AttentionBackendSpec,
                                               attention_fn: AttentionFn) -> None:
        """``[real | pad]`` packing ((8, 2, 4) rows: cu = [0, 5, 8], max 5, valid 5) and one document
        whose keys past ``valid_kv_length`` are padding: real rows match, padding values never reach them."""
        self._require(backend_spec, "packed_varlen", "prefix_kv_slicing")
        import torch

        from ..attention.metadata import AttentionMetadata

        dtype = self._dtypes(backend_spec)[0]
        d = self._head_dim(backend_spec)
        for total, cu, used in ((8, (0, 5, 8), 5), (24, (0, 24), 17)):
            md = AttentionMetadata(cu_seqlens_q=cu, max_seqlen_q=used, max_seqlen_k=used, valid_kv_length=used)
            q, k, v = (self._rand(total, 2, d, seed=s, dtype=dtype) for s in (50, 51, 52))
            out = attention_fn(q, k, v, metadata=md)
            want = self._reference(q[:used], k[:used], v[:used], metadata=AttentionMetadata(cu_seqlens_q=(0, used)))
            self._check_close(out[:used], want, dtype, f"valid_kv_length {used}/{total} {dtype}")
            k2, v2 = k.clone(), v.clone()
            k2[used:], v2[used:] = 1e3, -1e3
            again = attention_fn(q, k2, v2, metadata=md)
            assert torch.equal(again[:used], out[:used]), "padding keys past valid_kv_length changed real rows"

    def test_spans_match_reference(self, backend_spec: AttentionBackendSpec, attention_fn: AttentionFn) -> None:
        """Causal documents with bidirectional spans (text causal, each image's tokens see each other)."""
        self._require(backend_spec, "packed_varlen", "spans")
        from ..attention.metadata import AttentionMetadata, AttentionSpan

        dtype = self._dtypes(backend_spec)[0]
        d = self._head_dim(backend_spec)
        md = AttentionMetadata(cu_seqlens_q=(0, 14, 23), causal=True, spans=(
            (AttentionSpan(3, 8), AttentionSpan(10, 13)), (AttentionSpan(0, 4),)))
        q, k, v = (self._rand(23, 4, d, seed=s, dtype=dtype) for s in (60, 61, 62))
        self._check_close(attention_fn(q, k, v, metadata=md), self._reference(q, k, v, metadata=md), dtype,
                          f"spans {dtype}")

    def test_dense_backend_accepts_and_ignores_a_sparse_plan(self, backend_spec: AttentionBackendSpec,
                                                             attention_fn: AttentionFn) -> None:
        self._require_packed(backend_spec)
        if backend_spec.capabilities.sparse:
            pytest.skip(f"{backend_spec.name!r} declares sparse: it executes plans (checked by its own tests)")
        import attrs
        import torch

        dtype = self._dtypes(backend_spec)[0]
        ps, q, k, v, md = self._packed_inputs(backend_spec, dtype, seed=70)
        n = ps.valid_length
        planned = attrs.evolve(md, sparse_plan=object())
        assert torch.equal(attention_fn(q, k, v, metadata=planned)[:n], attention_fn(q, k, v, metadata=md)[:n])
        host = self._build_host(Settings(attention_backend=backend_spec.name))
        with pytest.raises(UnsupportedFeature, match="sparse not supported"):
            host.select_attention(AttentionRequirement(platform=self.platform, dtype=dtype,
                                                       head_dim=self._head_dim(backend_spec), packed_varlen=True,
                                                       sparse=True))

    def test_packed_documents_are_isolated(self, backend_spec: AttentionBackendSpec, attention_fn: AttentionFn) -> None:
        """Perturbing document j leaves every other document's output bit-identical."""
        self._require_packed(backend_spec)
        import torch

        dtype = self._dtypes(backend_spec)[0]
        ps, q, k, v, md = self._packed_inputs(backend_spec, dtype)
        base = attention_fn(q, k, v, metadata=md)
        o = ps.offsets
        for j in range(len(ps.lengths)):
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            for t in (q2, k2, v2):
                t[o[j]:o[j + 1]] = t[o[j]:o[j + 1]] * -2 + 1
            out = attention_fn(q2, k2, v2, metadata=md)
            for i in range(len(ps.lengths)):
                if i != j:
                    assert torch.equal(out[o[i]:o[i + 1]], base[o[i]:o[i + 1]]), (
                        f"perturbing document {j} changed document {i}: documents leak into each other")
            assert not torch.equal(out[o[j]:o[j + 1]], base[o[j]:o[j + 1]]), f"document {j} ignored its own inputs"

    def test_padding_never_leaks_into_real_rows(self, backend_spec: AttentionBackendSpec,
                                                attention_fn: AttentionFn) -> None:
        self._require_packed(backend_spec)
        import torch

        dtype = self._dtypes(backend_spec)[0]
        ps, q, k, v, md = self._packed_inputs(backend_spec, dtype)
        n = ps.valid_length
        base = attention_fn(q, k, v, metadata=md)
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[n:], k2[n:], v2[n:] = 1e3, 1e3, -1e3
        out = attention_fn(q2, k2, v2, metadata=md)
        assert torch.equal(out[:n], base[:n]), "values in padding rows changed the real rows' output"
        assert bool(torch.isfinite(out[:n]).all())

    def test_rejects_inconsistent_inputs(self, backend_spec: AttentionBackendSpec, attention_fn: AttentionFn) -> None:

        d = self._head_dim(backend_spec)
        dtype = self._dtypes(backend_spec)[0]
        q = self._rand(1, 8, 4, d, seed=30, dtype=dtype)
        k = v = self._rand(1, 8, 3, d, seed=31, dtype=dtype)  # 4 query heads over 3 kv heads
        with pytest.raises(Exception):  # noqa: B017 - any error beats a silently wrong result
            attention_fn(q, k, v)
        if backend_spec.capabilities.packed_varlen:
            q = k = v = self._rand(8, 4, d, seed=32, dtype=dtype)
            from ..attention.metadata import AttentionMetadata

            too_long = AttentionMetadata(cu_seqlens_q=(0, 4, 12))
            with pytest.raises(Exception):  # noqa: B017
                attention_fn(q, k, v, metadata=too_long)

