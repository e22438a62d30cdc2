"""Checks for cache methods: :class:`CacheMethodConformance` applies a method to a model's tiny preset."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Union

import pytest

from ..config import Settings
from ..plugin_host.host import PluginHost
from ..specs import CacheMethodSpec
from .model import output_bytes
from .plugin import add_loaded, isolated_host

if TYPE_CHECKING:
    import torch

    from ..engine.api import Engine

#: What :func:`_snapshot` records per key: a weight, a class name, overridden attribute names, hook counts.
Snapshot = dict[str, Union["torch.Tensor", str, list[str], tuple[int, int]]]


def _modules(pipeline: object) -> dict[str, torch.nn.Module]:
    """Every ``torch.nn.Module`` the pipeline holds as an attribute, by attribute name."""
    import torch

    return {k: v for k, v in vars(pipeline).items() if isinstance(v, torch.nn.Module)}


def _snapshot(pipeline: object) -> Snapshot:
    """Weights (cloned), module tree and per-instance attribute overrides (e.g. a patched ``forward``)."""
    snap: Snapshot = {}
    for attr, module in _modules(pipeline).items():
        for name, tensor in module.state_dict().items():
            snap[f"{attr}.{name}"] = tensor.detach().clone()
        for name, sub in module.named_modules():
            snap[f"{attr}.{name}#type"] = type(sub).__qualname__
            snap[f"{attr}.{name}#overrides"] = sorted(k for k in vars(sub) if k in ("forward", "__call__"))
            snap[f"{attr}.{name}#hooks"] = (len(sub._forward_hooks), len(sub._forward_pre_hooks))
    return snap


def _diff(before: Snapshot, after: Snapshot) -> list[str]:
    import torch

    changed = sorted(set(before) ^ set(after))
    for key in set(before) & set(after):
        a, b = before[key], after[key]
        same = (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a, b.to(a.device)) if isinstance(a, torch.Tensor) else a == b)
        if not same:
            changed.append(key)
    return sorted(changed)


class CacheMethodConformance:
    """Conformance checks for one cache method on a model plugin's tiny preset.

    Attributes to set:
      ``cache_method``: the registered method name. Required.
      ``model`` / ``plugin_module``: the tiny preset and the plugin registering its model. Required.
      ``cache_plugin_module``: entry-point target registering the method (``None`` for core built-ins).
      ``cache_config``: configuration passed to the method (``None`` for its defaults).
      ``reuse_config``: configuration under which the method must reuse at least one step (``None``: use
      ``cache_config``). Random-weight presets rarely pass a similarity test, so force reuse: the core's step
      caches take ``{"force_hits": [2, 3]}`` (step indices to reuse; warm-up and the last step still compute).
      ``expect_reuse``: ``False`` for a method that never skips a step (e.g. the exact ``adaln_schedule``).
      ``params``: sampling parameters; use several steps so the method has something to reuse.
    """

    cache_method: str = ""
    model: str = ""
    plugin_module: str = ""
    cache_plugin_module: str | None = None
    cache_config: object = None
    reuse_config: object = None
    expect_reuse: bool = True
    prompt: str = "a small red cube on a wooden table"
    params: dict[str, Any] = {"num_inference_steps": 6}
    seed: int = 7

    @classmethod
    def make_host(cls, settings: Settings) -> PluginHost:
        if not (cls.cache_method and cls.model and cls.plugin_module):
            pytest.fail(f"{cls.__name__}: set `cache_method`, `model` and `plugin_module`")
        host = isolated_host(settings)
        for target in filter(None, (cls.plugin_module, cls.cache_plugin_module)):
            add_loaded(host, target)
        return host

    @pytest.fixture(scope="class")
    @classmethod
    def cache_engine(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        from ..engine.api import Engine

        settings = Settings(cache_dir=str(tmp_path_factory.mktemp("omnicore-cache")))
        engine = Engine(cls.model, host=cls.make_host(settings), settings=settings)
        try:
            yield engine
        finally:
            engine.close()

    def run(self, engine: Engine) -> list[bytes]:
        return output_bytes(engine.generate(self.prompt, seed=self.seed, **self.params))

    def spec(self, engine: Engine) -> CacheMethodSpec:
        return engine.host.cache_methods.get(self.cache_method)

    def test_spec_is_well_formed(self, cache_engine: Engine) -> None:
        spec = self.spec(cache_engine)
        assert callable(spec.load_impl()), f"impl {spec.impl!r} must be apply(pipeline, config) -> handle"
        unknown = [c for c in spec.conflicts if c not in cache_engine.host.cache_methods]
        assert not unknown, f"conflicts names unregistered cache methods {unknown}"
        assert spec.name not in spec.conflicts
        assert spec.name in cache_engine.spec.capabilities.cache_methods, (
            f"model {cache_engine.spec.name!r} does not declare support for {spec.name!r}")

    def test_apply_then_remove_leaves_the_pipeline_unchanged(self, cache_engine: Engine) -> None:
        baseline, before = self.run(cache_engine), _snapshot(cache_engine.pipeline)
        handle = cache_engine.host.enable_cache(cache_engine.pipeline, self.spec(cache_engine), self.cache_config)
        try:
            self.run(cache_engine)
        finally:
            handle.remove()
        changed = _diff(before, _snapshot(cache_engine.pipeline))
        assert not changed, f"after remove() these differ from before apply: {changed[:10]}"
        assert self.run(cache_engine) == baseline, "outputs after remove() differ from outputs before apply"

    def test_state_is_per_request(self, cache_engine: Engine) -> None:
        """With the method on, the same request twice gives identical bytes: nothing leaks between requests."""
        handle = cache_engine.host.enable_cache(cache_engine.pipeline, self.spec(cache_engine), self.cache_config)
        try:
            first, second = self.run(cache_engine), self.run(cache_engine)
        finally:
            handle.remove()
        assert first == second, "the cache carried state from one request into the next"

    def test_reuse_happens_and_is_reported(self, cache_engine: Engine) -> None:
        """Under ``reuse_config`` the method skips at least one step, and outputs report it as
        ``metrics["cache_reused_steps"]`` (0 without the method)."""
        if not self.expect_reuse:
            pytest.skip(f"{type(self).__name__} declares expect_reuse = False")
        plain = cache_engine.generate(self.prompt, seed=self.seed, **self.params)
        assert all(o.metrics.get("cache_reused_steps") == 0 for o in plain), "reuse reported with no cache enabled"
        config = self.reuse_config if self.reuse_config is not None else self.cache_config
        handle = cache_engine.host.enable_cache(cache_engine.pipeline, self.spec(cache_engine), config)
        try:
            outputs = cache_engine.generate(self.prompt, seed=self.seed, **self.params)
        finally:
            handle.remove()
        reused = [o.metrics.get("cache_reused_steps") for o in outputs]
        assert all(isinstance(r, int) and r > 0 for r in reused), (
            f"{self.cache_method!r} reused no step (cache_reused_steps={reused}), so the other checks proved "
            "nothing about skipping: set reuse_config (e.g. {'force_hits': [2, 3]}) to force reuse")
