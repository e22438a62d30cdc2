"""Exact-schedule AdaLN cache: every rule of the reference contract (keys, projection, model-level prepare,
fall-back, step selection), with independent references (struct bit patterns, torch.unique, dense math)."""

from __future__ import annotations

import logging
import struct

import pytest
import torch
import torch.distributed as dist
from omnicore.cache.adaln_schedule import (
    ABSENT,
    AdaLNProjection,
    AdaLNScheduleConfig,
    AdaLNScheduleController,
    apply_adaln_schedule,
    float32_bits,
    schedule_key,
    step_timesteps,
)
from omnicore.cache.adaln_schedule import projection as projection_module
from omnicore.engine.protocol import BasePipeline, DenoiseState
from omnicore.errors import UnsupportedFeature
from omnicore.plugin_host.host import PluginHost
from torch import nn

T_DIM, H = 8, 4


# ---------------------------------------------------------------------------------------------- toy DiT


class TimeEmbedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in, self.proj_out = nn.Linear(16, T_DIM), nn.Linear(T_DIM, T_DIM)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(8, dtype=torch.float32) / 8 * 9.2)
        args = t[:, None].float() * 1000 * freqs[None]
        return self.proj_out(nn.functional.silu(self.proj_in(torch.cat([args.cos(), args.sin()], -1))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.adaln_proj = AdaLNProjection(T_DIM, H, 6, 3)
        self.mix = nn.Linear(H, H, bias=False)

    def forward(self, x, t_emb, idx):
        shift, scale, gate, shift2, scale2, gate2 = self.adaln_proj(t_emb)
        x = x + gate[idx] * self.mix(nn.functional.layer_norm(x, (H,)) * (1 + scale[idx]) + shift[idx])
        return x + gate2[idx] * torch.tanh(x * (1 + scale2[idx]) + shift2[idx])


class Final(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.adaln_proj = AdaLNProjection(T_DIM, H, 2, 1)

    def forward(self, x, t_emb, inverse):
        shift, scale = self.adaln_proj(t_emb)
        return x * (1 + scale[inverse]) + shift[inverse]


class DiT(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.time_embedder = TimeEmbedder()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.final = Final()
        for m in self.modules():  # non-zero AdaLN weights so the test sees real modulation
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.5)
        self.adaln = AdaLNScheduleController(
            lambda: [b.adaln_proj for b in self.blocks] + [self.final.adaln_proj], self.time_embedder)

    def forward(self, x, unique_timesteps, inverse, tags, adaln_step_index=ABSENT):
        t_emb = self.adaln.select(adaln_step_index)
        if t_emb is None:
            t_emb = self.time_embedder(unique_timesteps)
        idx = inverse * 3 + tags.clamp(min=0)
        for block in self.blocks:
            x = block(x, t_emb, idx)
        return self.final(x, t_emb, inverse)


S = 6
TAGS = torch.tensor([1, 0, 0, 0, 2, -1])


def _schedule(values_per_step: list[list[float]]):
    """Per step: row timesteps → StepTimesteps (unique, inverse, bits)."""
    metas = []
    for vals in values_per_step:
        rows = torch.tensor([vals[i % len(vals)] for i in range(S)], dtype=torch.float32)
        metas.append(step_timesteps(rows))
    return metas


SCHED_A = [[0.9, 0.95], [0.5, 0.7]]
SCHED_B = [[0.9, 0.95], [0.4, 0.7]]


def _prepare(model, metas, offload=False):
    return model.adaln.prepare([m.unique_timesteps for m in metas], schedule_key(metas), offload_weights=offload)


def _proj_param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for proj in model.adaln.projections for p in proj.parameters())


# ---------------------------------------------------------------------------------------------- keys


def test_float32_bits_are_signed_int32_reinterpretation():
    values = torch.tensor([0.5, -2.0, 1e-30, 0.999], dtype=torch.float32)
    expected = tuple(struct.unpack("<i", struct.pack("<f", v))[0] for v in values.tolist())
    assert float32_bits(values) == expected
    assert float32_bits(torch.tensor([-2.0]))[0] < 0


@pytest.mark.parametrize("bad", [torch.tensor([0.5], dtype=torch.float64), torch.tensor([1]), [0.5],
                                 torch.tensor([0.5], dtype=torch.bfloat16)])
def test_float32_bits_rejects_non_cpu_float32(bad):
    with pytest.raises(ValueError, match="schedule key values must be a CPU float32 tensor"):
        float32_bits(bad)


def test_schedule_key_equality_follows_float32_rounding():
    def key(v):
        return schedule_key(_schedule([[v]]))

    assert key(0.5) == key(0.5 + 1e-12)
    assert key(0.25) != key(0.25000003)


def test_schedule_key_errors():
    with pytest.raises(ValueError, match="at least one denoise step"):
        schedule_key([])
    with pytest.raises(ValueError, match="missing host timestep_bits"):
        schedule_key([{"unique_timesteps": torch.tensor([0.5])}])
    assert schedule_key([{"timestep_bits": (1, 2)}]) == ((1, 2),)


def test_step_timesteps_matches_torch_unique():
    rows = torch.tensor([0.7, 0.2, 0.7, 0.9, 0.2], dtype=torch.float32)
    meta = step_timesteps(rows)
    ref_u, ref_inv = torch.unique(rows, sorted=True, return_inverse=True)
    assert torch.equal(meta.unique_timesteps, ref_u) and torch.equal(meta.inverse_indices, ref_inv)
    assert meta.timestep_bits == float32_bits(ref_u)


# ---------------------------------------------------------------------------------------------- projection


def _proj(dtype=torch.float32) -> AdaLNProjection:
    torch.manual_seed(3)
    return AdaLNProjection(T_DIM, H, 6, 3, dtype=dtype)


def test_direct_path_is_silu_linear_reshape_chunk():
    proj = _proj()
    t = torch.randn(2, T_DIM)
    out = proj(t)
    dense = (nn.functional.silu(t) @ proj.linear.weight.T + proj.linear.bias).reshape(6, 6 * H)
    assert len(out) == 6
    for i, chunk in enumerate(out):
        torch.testing.assert_close(chunk, dense[:, i * H:(i + 1) * H], rtol=1e-6, atol=1e-6)


def test_direct_path_computes_in_weight_dtype():
    proj = _proj(torch.bfloat16)
    assert proj(torch.randn(1, T_DIM))[0].dtype == torch.bfloat16


def test_table_path_is_bit_identical_and_never_calls_linear():
    proj = _proj()
    t_embs = [torch.randn(2, T_DIM), torch.randn(1, T_DIM), torch.randn(3, T_DIM)]
    direct = [proj(t) for t in t_embs]
    table = proj.build_table(t_embs)
    assert table.shape == (3, 9, 6 * H)
    assert torch.count_nonzero(table[1, 3:]) == 0  # padded rows
    cursor = torch.zeros((), dtype=torch.int64)
    proj.install(table, cursor)
    calls = []
    handle = proj.linear.register_forward_hook(lambda *a: calls.append(1))
    for step, t in enumerate(t_embs):
        cursor.fill_(step)
        for a, b in zip(proj(t), direct[step]):
            assert torch.equal(a, b)
    handle.remove()
    assert calls == []
    with pytest.raises(ValueError, match="row capacity is too small: 9 < 12"):
        proj(torch.randn(4, T_DIM))


def test_table_is_a_non_persistent_buffer():
    proj = _proj()
    proj.install(proj.build_table([torch.randn(1, T_DIM)]), torch.zeros((), dtype=torch.int64))
    assert "table" not in proj.state_dict()
    assert dict(proj.named_buffers())["table"] is proj.table


def test_table_without_cursor_is_an_error():
    proj = _proj()
    proj.install(proj.build_table([torch.randn(1, T_DIM)]), torch.zeros((), dtype=torch.int64))
    proj.cursor = None
    with pytest.raises(RuntimeError, match="without a step cursor"):
        proj(torch.randn(1, T_DIM))


def test_install_validation():
    proj = _proj()
    good = proj.build_table([torch.randn(1, T_DIM)])
    cursor = torch.zeros((), dtype=torch.int64)
    with pytest.raises(ValueError, match=r"must be \[steps, rows, W\]"):
        proj.install(good[0], cursor)
    with pytest.raises(ValueError, match=r"must be \[steps, rows, W\]"):
        proj.install(good[..., :-1], cursor)
    with pytest.raises(ValueError, match="dtype"):
        proj.install(good.double(), cursor)
    for bad_cursor in (torch.zeros(1, dtype=torch.int64), torch.zeros((), dtype=torch.int32), 0):
        with pytest.raises(ValueError, match="0-dim int64"):
            proj.install(good, bad_cursor)
    with pytest.raises(ValueError, match="share a device"):
        proj.install(good, torch.zeros((), dtype=torch.int64, device="meta"))
    assert proj.table is None and proj.cursor is None  # nothing half-installed


def _storage_bytes(module: nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in module.parameters())


def test_offload_frees_storage_and_restore_is_bit_exact():
    proj = _proj()
    state_before = {k: v.clone() for k, v in proj.linear.state_dict().items()}
    sd_bytes = sum(v.numel() * v.element_size() for v in proj.linear.state_dict().values())
    t = torch.randn(2, T_DIM)
    direct = proj(t)
    with pytest.raises(RuntimeError, match="require an installed precomputed table"):
        proj.offload()
    proj.install(proj.build_table([t]), torch.zeros((), dtype=torch.int64))
    params_before = list(proj.parameters())
    assert _storage_bytes(proj) == sd_bytes
    freed = proj.offload()
    assert freed == sd_bytes
    assert _storage_bytes(proj) == 0  # measured: the parameters hold no storage any more
    assert list(proj.parameters()) == params_before  # same objects
    assert all(p.numel() == 0 and p.device.type == "cpu" for p in proj.parameters())
    assert proj.projection_bytes() == sd_bytes
    assert proj.offload() == 0  # idempotent
    for a, b in zip(proj(t), direct):
        assert torch.equal(a, b)
    proj.clear()
    assert proj.table is None and proj.cursor is None and not proj.offloaded
    for k, v in proj.linear.state_dict().items():
        assert torch.equal(v, state_before[k])
    for a, b in zip(proj(t), direct):
        assert torch.equal(a, b)


def test_offload_eligibility_meta_and_empty():
    meta = AdaLNProjection(T_DIM, H, 6, 3, device="meta")
    assert not meta.offload_eligible()
    meta.install(torch.zeros(1, 3, 6 * H, device="meta"), torch.zeros((), dtype=torch.int64, device="meta"))
    with pytest.raises(RuntimeError, match="does not support DTensor, meta, or empty parameters"):
        meta.offload()
    empty = _proj()
    empty.linear.bias.data = torch.empty(0)
    assert not empty.offload_eligible()
    no_params = _proj()
    no_params.linear.weight = None
    no_params.linear.bias = None
    assert not no_params.offload_eligible()


def test_offload_failure_rolls_back(monkeypatch):
    proj = _proj()
    proj.install(proj.build_table([torch.randn(1, T_DIM)]), torch.zeros((), dtype=torch.int64))
    before = {k: v.clone() for k, v in proj.linear.state_dict().items()}
    real_empty = torch.empty
    calls = []

    def failing_empty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("simulated")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(projection_module.torch, "empty", failing_empty)
    with pytest.raises(MemoryError):
        proj.offload()
    monkeypatch.undo()
    assert not proj.offloaded
    for k, v in proj.linear.state_dict().items():
        assert torch.equal(v, before[k])


# ---------------------------------------------------------------------------------------------- model level


def _count_builds(model, monkeypatch) -> list[int]:
    counts = []
    real = AdaLNProjection.compute_flat

    def counting(self, t_emb):
        counts.append(id(self))
        return real(self, t_emb)

    monkeypatch.setattr(AdaLNProjection, "compute_flat", counting)
    return counts


def _forward_all(model, metas, cached: bool):
    x = torch.linspace(-1, 1, S * H).reshape(S, H)
    outs = []
    for step, m in enumerate(metas):
        kwargs = {"adaln_step_index": step} if cached else {}
        outs.append(model(x, m.unique_timesteps, m.inverse_indices, TAGS, **kwargs))
    return outs


def test_cached_output_equals_uncached_exactly_and_offload():
    model = DiT()
    metas = _schedule(SCHED_A)
    with torch.no_grad():
        uncached = _forward_all(model, metas, cached=False)
        cache = _prepare(model, metas, offload=True)
        assert cache is not None
        cached = _forward_all(model, metas, cached=True)
    for a, b in zip(cached, uncached):
        assert torch.equal(a, b)
    assert all(p.offloaded for p in model.adaln.projections)
    assert all(p.numel() == 0 for proj in model.adaln.projections for p in proj.parameters())
    with torch.no_grad():
        model.adaln.clear()
        again = _forward_all(model, metas, cached=False)
    for a, b in zip(again, uncached):
        assert torch.equal(a, b)


def test_prepare_reuse_rebuild_and_accounting(monkeypatch):
    model = DiT()
    param_bytes = _proj_param_bytes(model)
    counts = _count_builds(model, monkeypatch)
    n_proj = len(model.adaln.projections)
    with torch.inference_mode():
        first = _prepare(model, _schedule(SCHED_A), offload=True)
    assert len(counts) == 2 * n_proj and all(counts.count(id(p)) == 2 for p in model.adaln.projections)
    assert first.steps == 2 and first.max_unique_timesteps == 2
    assert first.offloaded_projection_bytes == param_bytes == first.projection_bytes
    table_bytes = sum(p.table_bytes() for p in model.adaln.projections)
    assert first.table_bytes == table_bytes
    assert first.net_memory_saved_bytes == param_bytes - table_bytes
    with torch.inference_mode():
        assert _prepare(model, _schedule(SCHED_A), offload=True) is first
    assert len(counts) == 2 * n_proj
    with torch.inference_mode():
        second = _prepare(model, _schedule(SCHED_B), offload=True)
    assert second is not first and model.adaln.cache is second
    assert all(counts.count(id(p)) == 4 for p in model.adaln.projections)
    assert all(p.offloaded for p in model.adaln.projections)
    assert second.offloaded_projection_bytes == param_bytes


def test_new_tables_are_built_before_live_projections_change(monkeypatch):
    model = DiT()
    with torch.no_grad():
        _prepare(model, _schedule(SCHED_A))
        old_tables = [p.table for p in model.adaln.projections]
        seen = []
        real = AdaLNProjection.compute_flat

        def spy(self, t_emb):
            seen.append([p.table is t for p, t in zip(model.adaln.projections, old_tables)])
            return real(self, t_emb)

        monkeypatch.setattr(AdaLNProjection, "compute_flat", spy)
        _prepare(model, _schedule(SCHED_B))
    assert seen and all(all(flags) for flags in seen)
    assert all(p.table is not t for p, t in zip(model.adaln.projections, old_tables))


def test_tables_not_smaller_than_weights_fall_back(caplog):
    model = DiT()
    long = _schedule([[0.05 * (i + 1)] for i in range(12)])
    with caplog.at_level(logging.WARNING, logger="omnicore.cache.adaln_schedule"), torch.no_grad():
        _prepare(model, _schedule(SCHED_A), offload=True)  # an earlier cache is dropped by the fall-back
        assert _prepare(model, long, offload=True) is None
    assert "not smaller" in caplog.text
    assert model.adaln.cache is None
    assert all(p.table is None and not p.offloaded for p in model.adaln.projections)
    assert all(p.numel() > 0 for proj in model.adaln.projections for p in proj.parameters())
    with torch.no_grad():  # without weight offload the tables are installed whatever their size
        cache = _prepare(model, long, offload=False)
    assert cache is not None and cache.table_bytes > cache.projection_bytes
    assert cache.offloaded_projection_bytes == 0


def test_prepare_argument_errors():
    model = DiT()
    metas = _schedule(SCHED_A)
    with pytest.raises(ValueError, match="at least one denoise step"):
        model.adaln.prepare([], ())
    with pytest.raises(ValueError, match="key/plan length mismatch"):
        model.adaln.prepare([m.unique_timesteps for m in metas], schedule_key(metas)[:1])
    model.adaln._time_embedder = lambda ts: torch.zeros(ts.shape[0], T_DIM, device=ts.device)
    with pytest.raises(ValueError, match="one device"):
        model.adaln.prepare([metas[0].unique_timesteps, metas[1].unique_timesteps.to("meta")],
                            schedule_key(metas))
    assert model.adaln.cache is None


def test_offload_failure_keeps_tables_and_weights(monkeypatch, caplog):
    model = DiT()
    last = model.adaln.projections[-1]

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(last, "offload", broken)
    with torch.no_grad(), caplog.at_level(logging.ERROR, logger="omnicore.cache.adaln_schedule"):
        cache = _prepare(model, _schedule(SCHED_A), offload=True)
    assert cache is not None and cache.offloaded_projection_bytes == 0
    assert all(p.table is not None and not p.offloaded for p in model.adaln.projections)
    assert all(p.numel() > 0 for proj in model.adaln.projections for p in proj.parameters())


def test_step_selection_rules():
    model = DiT()
    assert model.adaln.select() is None
    with pytest.raises(ValueError, match="without a prepared AdaLN schedule"):
        model.adaln.select(0)
    with pytest.raises(ValueError, match="without a prepared AdaLN schedule"):
        model.adaln.select(None)
    with torch.no_grad():
        cache = _prepare(model, _schedule(SCHED_A))
    for bad in (True, None, 1.0, ABSENT):
        with pytest.raises(ValueError, match="must be an int"):
            model.adaln.select(bad)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
            model.adaln.select(bad)
    assert model.adaln.select(1) is cache.t_embs[1]
    assert int(cache.cursor) == 1
    model.adaln.clear()
    model.adaln.clear()  # no-op without a cache
    assert model.adaln.select() is None


# ---------------------------------------------------------------------------------------------- cache method


class Pipe(BasePipeline):
    def __init__(self, host) -> None:
        self.host = host
        self.model = DiT()
        self.adaln_schedule = self.model.adaln
        self.plans = 0

    def state(self, sched) -> DenoiseState:
        metas = _schedule(sched)
        return DenoiseState(requests=[], num_steps=len(metas), latents=torch.linspace(-1, 1, S * H).reshape(S, H),
                            extras={"metas": metas})

    def adaln_schedule_plan(self, state):
        self.plans += 1
        metas = state.extras["metas"]
        return [m.unique_timesteps for m in metas], schedule_key(metas)

    def predict(self, state, step):
        m = state.extras["metas"][step]
        kwargs = {"adaln_step_index": state.extras["adaln_step_index"]} if "adaln_step_index" in state.extras else {}
        return self.model(state.latents, m.unique_timesteps, m.inverse_indices, TAGS, **kwargs)

    def update(self, state, step, prediction):
        state.latents = state.latents + 0.5 * prediction
        return state


def _loop(host, pipe, state):
    with torch.no_grad():
        for step in range(state.num_steps):
            state = host.denoise(pipeline=pipe, state=state, step=step)
    return state


def test_cache_method_prepares_once_per_batch_and_is_exact():
    host = PluginHost(autoload=False)
    pipe = Pipe(host)
    reference = _loop(host, pipe, pipe.state(SCHED_A)).latents
    handle = host.enable_cache(pipe, host.cache_methods.get("adaln_schedule"),
                               AdaLNScheduleConfig(offload_weights=True))
    state = _loop(host, pipe, pipe.state(SCHED_A))
    assert pipe.plans == 1
    assert torch.equal(state.latents, reference)
    assert state.extras["adaln_schedule"] is pipe.model.adaln.cache
    assert all(p.offloaded for p in pipe.model.adaln.projections)
    _loop(host, pipe, pipe.state(SCHED_A))
    assert pipe.plans == 2
    handle.remove()
    assert pipe.model.adaln.cache is None
    assert all(not p.offloaded and p.table is None for p in pipe.model.adaln.projections)
    assert torch.equal(_loop(host, pipe, pipe.state(SCHED_A)).latents, reference)


def test_cache_method_fall_back_runs_direct_path():
    host = PluginHost(autoload=False)
    pipe = Pipe(host)
    long = [[0.05 * (i + 1)] for i in range(12)]
    reference = _loop(host, pipe, pipe.state(long)).latents
    apply_adaln_schedule(pipe, {"offload_weights": True})
    state = _loop(host, pipe, pipe.state(long))
    assert state.extras["adaln_schedule"] is None and "adaln_step_index" not in state.extras
    assert torch.equal(state.latents, reference)


def test_cache_method_needs_a_declaration():
    host = PluginHost(autoload=False)
    pipe = Pipe(host)
    del pipe.adaln_schedule
    with pytest.raises(UnsupportedFeature, match="declares no AdaLN schedule"):
        apply_adaln_schedule(pipe)


# ---------------------------------------------------------------------------------------------- DTensor
# A real torch.distributed.tensor.DTensor on a single-process gloo group (world size 1, HashStore
# rendezvous, no network), so this runs on any CPU machine. The projection's linear gathers the DTensor
# weight in forward the way FSDP's pre-forward all-gather does in production.


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if owns_group:
            dist.destroy_process_group()


class GatheringLinear(nn.Linear):
    def forward(self, x):
        from torch.distributed.tensor import DTensor

        w = self.weight.full_tensor() if isinstance(self.weight, DTensor) else self.weight
        return nn.functional.linear(x, w, self.bias)


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_dtensor_parameter_is_not_offloaded(mesh, caplog):
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    model = DiT()
    metas = _schedule(SCHED_A)
    x = torch.linspace(-1, 1, S * H).reshape(S, H)
    with torch.no_grad():
        reference = [model(x, m.unique_timesteps, m.inverse_indices, TAGS) for m in metas]
    proj = model.blocks[1].adaln_proj
    old = proj.linear
    new = GatheringLinear(old.in_features, old.out_features)
    new.load_state_dict(old.state_dict())
    new.weight = nn.Parameter(distribute_tensor(old.weight.detach().clone(), mesh, [Replicate()]))
    proj.linear = new
    assert isinstance(proj.linear.weight, DTensor)
    assert not proj.offload_eligible()
    with torch.no_grad(), caplog.at_level("WARNING", logger="omnicore.cache.adaln_schedule"):
        cache = model.adaln.prepare([m.unique_timesteps for m in metas], schedule_key(metas), offload_weights=True)
        cached = [model(x, m.unique_timesteps, m.inverse_indices, TAGS, adaln_step_index=i)
                  for i, m in enumerate(metas)]
    assert cache is not None
    assert cache.offloaded_projection_bytes == 0
    assert "unsupported" in caplog.text
    assert all(p.table is not None and not p.offloaded for p in model.adaln.projections)
    assert proj.linear.weight.to_local().numel() == old.weight.numel()
    # local-shard accounting counts the DTensor's local shard
    assert proj.projection_bytes() == sum(p.numel() * p.element_size() for p in old.parameters())
    for a, b in zip(cached, reference):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="does not support DTensor"):
        proj.offload()
