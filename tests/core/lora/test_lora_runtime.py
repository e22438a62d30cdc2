"""Unmerged per-row adapters on a toy network: a mixed batch equals each row alone and peft's merged copy."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _lora_helpers import MODULES, SPEC, Holder, Toy, make_peft_adapter, merged_copy, peft_to_kohya
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.lora import AdapterRegistry, LoRA, packed_rows, sample_rows
from omnicore.lora.runtime import LoRARuntime
from omnicore.ops.table import PlatformOps
from torch import nn


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    base = Toy()
    return {
        "a": make_peft_adapter(base, MODULES, root / "a", rank=4, seed=1),
        "b": make_peft_adapter(base, ("blocks.0.q", "blocks.1.o"), root / "b", rank=8, seed=2, alpha=4),
        "c": make_peft_adapter(base, MODULES[:3], root / "c", rank=8, seed=3, use_rslora=True),
        "d": make_peft_adapter(base, ("head",), root / "d", rank=4, seed=4),
    }


def _runtime(model: nn.Module, root: Path, **kwargs) -> LoRARuntime:
    return LoRARuntime(AdapterRegistry(lora_dirs=[root], **kwargs), SPEC, Holder(model), PlatformOps("cpu"))


def _request(*loras: LoRA, outputs: int = 1) -> GenerationRequest:
    return GenerationRequest("x", params=SamplingParams(num_outputs=outputs), loras=loras)


def test_mixed_batch_equals_each_alone_and_the_merged_copy(adapters: dict[str, Path]) -> None:
    model = Toy()
    root = adapters["a"].parent
    runtime = _runtime(model, root)
    x = torch.randn(5, 7, 16)
    names = ["a", "b", None, "c", "d"]
    reqs = [_request(LoRA(n)) if n else _request() for n in names]
    runtime.activate(reqs)
    with torch.no_grad():
        mixed = model(x)
    for i, name in enumerate(names):
        runtime.activate([reqs[i]])
        with torch.no_grad():
            alone = model(x[i:i + 1])
        torch.testing.assert_close(mixed[i:i + 1], alone, atol=1e-6, rtol=1e-6)
        reference = merged_copy(model, [(adapters[name], 1.0)]) if name else model
        runtime.deactivate()
        with torch.no_grad():
            want = reference(x[i:i + 1])
        torch.testing.assert_close(mixed[i:i + 1], want, atol=1e-5, rtol=1e-5)
        if name:  # the adapter changes something (the comparison can fail)
            assert (want - model(x[i:i + 1])).abs().max() > 1e-3


def test_two_adapters_on_one_request_equal_merging_both(adapters: dict[str, Path]) -> None:
    model = Toy()
    runtime = _runtime(model, adapters["a"].parent)
    x = torch.randn(2, 3, 16)
    runtime.activate([_request(LoRA("a", 0.7), LoRA("b", -1.5)), _request(LoRA("c"))])
    with torch.no_grad():
        got = model(x)
        want = merged_copy(model, [(adapters["a"], 0.7), (adapters["b"], -1.5)])(x[:1])
        want_c = merged_copy(model, [(adapters["c"], 1.0)])(x[1:])
    torch.testing.assert_close(got[:1], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1:], want_c, atol=1e-5, rtol=1e-5)


def test_scale_zero_is_no_adapter_bit_for_bit(adapters: dict[str, Path]) -> None:
    model = Toy()
    runtime = _runtime(model, adapters["a"].parent)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        plain = model(x)
        runtime.activate([_request(LoRA("a", 0.0)), _request(LoRA("b", 0.0), LoRA("a", 0.0))])
        assert runtime.active is None  # nothing to add: the hooks return at once
        assert torch.equal(model(x), plain)
        runtime.activate([_request(LoRA("a", 0.0)), _request(LoRA("b"))])  # a zero row next to an adapted one
        out = model(x)
    assert torch.equal(out[:1], plain[:1])
    assert not torch.equal(out[1:], plain[1:])


def test_cfg_batches_repeat_the_outputs_and_sample_rows_override(adapters: dict[str, Path]) -> None:
    model = Toy()
    runtime = _runtime(model, adapters["a"].parent)
    x = torch.randn(2, 3, 16)
    runtime.activate([_request(LoRA("a")), _request(LoRA("b"))])
    with torch.no_grad():
        both = model(torch.cat([x, x]))  # [cond ; uncond]: sample j is output j % 2
        single = model(x)
        with sample_rows([1]):  # a forward over output 1 only
            second = model(x[1:])
    torch.testing.assert_close(both[:2], single)
    torch.testing.assert_close(both[2:], single)
    torch.testing.assert_close(second, single[1:])
    with pytest.raises(RuntimeError, match="not a multiple"):
        model(x[:1].expand(3, 3, 16))


def test_packed_rows_map_documents_to_samples(adapters: dict[str, Path]) -> None:
    """A packed sequence (documents of different lengths + padding) equals each document run alone."""
    model = Toy()
    runtime = _runtime(model, adapters["a"].parent)
    docs = [torch.randn(n, 16) for n in (5, 2, 4)]
    packed = torch.cat([*docs, torch.zeros(3, 16)])
    ends = torch.tensor([5, 7, 11])
    reqs = [_request(LoRA("a")), _request(), _request(LoRA("c"), LoRA("d", 2.0))]
    runtime.activate(reqs)
    with torch.no_grad(), packed_rows(ends, packed.shape[0]):
        out = model(packed)
    start = 0
    for doc, req, end in zip(docs, reqs, ends.tolist()):
        runtime.activate([req])
        with torch.no_grad():
            torch.testing.assert_close(out[start:end], model(doc[None])[0], atol=1e-6, rtol=1e-6)
        start = end
    runtime.deactivate()
    with torch.no_grad():
        torch.testing.assert_close(out[11:], model(packed[11:]), atol=1e-6, rtol=1e-6)  # padding: base only


def test_kohya_file_equals_the_peft_directory(adapters: dict[str, Path], tmp_path: Path) -> None:
    model = Toy()
    kohya = peft_to_kohya(adapters["a"], tmp_path / "a_kohya.safetensors")
    runtime = LoRARuntime(AdapterRegistry(lora_dirs=[adapters["a"].parent, tmp_path]), SPEC, Holder(model),
                          PlatformOps("cpu"))
    x = torch.randn(2, 3, 16)
    runtime.activate([_request(LoRA("a")), _request(LoRA(str(kohya)))])
    with torch.no_grad():
        out = model(torch.cat([x[:1], x[:1]]))
    torch.testing.assert_close(out[0], out[1], atol=1e-6, rtol=1e-6)


def test_base_weights_are_never_modified_and_remove_restores(adapters: dict[str, Path]) -> None:
    model = Toy()
    before = copy.deepcopy(model.state_dict())
    runtime = _runtime(model, adapters["a"].parent)
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        plain = model(x)
        runtime.activate([_request(LoRA("a"))])
        assert not torch.equal(model(x), plain)
        runtime.remove()
        assert torch.equal(model(x), plain)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_flattened_rows_split_over_declared_samples_and_base_only(adapters: dict[str, Path]) -> None:
    """Inside ``sample_rows`` a flattened ``[b * L, H]`` input splits evenly over the declared samples;
    ``base_only`` turns every adapter off (a stage on the base weights)."""
    from omnicore.lora import base_only

    model = Toy()
    runtime = _runtime(model, adapters["a"].parent)
    x = torch.randn(2, 3, 16)
    runtime.activate([_request(LoRA("a")), _request(LoRA("b"))])
    with torch.no_grad():
        want = model(x)
        with sample_rows([0, 1]):
            flat = model(x.reshape(6, 16))
        with base_only():
            plain = model(x)
        runtime.deactivate()
        assert torch.equal(plain, model(x))
    torch.testing.assert_close(flat.reshape(2, 3, -1), want)


def test_adapters_on_adaln_projections_are_refused_while_the_adaln_cache_is_on(adapters: dict[str, Path]) -> None:
    """A model whose LoRA targets name AdaLN projections (``LoRATargets.adaln``): with the adaln_schedule cache on
    (``runtime.adaln_cache``, set by the engine) an adapter touching one is refused naming the module, before it
    runs; scale 0 and adapters elsewhere pass; without the cache it is accepted."""
    import attrs
    from omnicore.lora import LoRAError
    from omnicore.lora.targets import TargetMap

    spec = attrs.evolve(SPEC, lora=attrs.evolve(SPEC.lora, adaln=("head",)))
    model = Toy()
    assert TargetMap.build(model, spec.lora, "toy").adaln == frozenset({"head"})
    runtime = LoRARuntime(AdapterRegistry(lora_dirs=[adapters["a"].parent]), spec, Holder(model), PlatformOps("cpu"))
    runtime.check([LoRA("d")])  # no cache: accepted
    runtime.adaln_cache = True
    with pytest.raises(LoRAError, match="adapts an AdaLN projection") as info:
        runtime.check([LoRA("b"), LoRA("d")])
    assert (info.value.adapter, info.value.key) == ("d", "head")
    runtime.check([LoRA("b"), LoRA("d", 0.0)])  # scale 0 is no adapter; b adapts no AdaLN projection
