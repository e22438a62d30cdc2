"""Regional ``torch.compile`` (``--compile``, ``Engine(compile=...)``): what is compiled, what is refused and why,
and that compiled generations equal eager ones within a stated tolerance.

Tolerance: the compiled blocks fuse elementwise work (inductor), so float32 results differ from eager in the last
bits; decoded frames may differ by at most 2 uint8 levels and audio by at most 1e-6 (measured: 1 level, 3.4e-8).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omnicore.cli.main import build_parser
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.errors import InvalidRequest, UnsupportedFeature
from omnicore.plugin_host.host import PluginHost
from omnicore.regional_compile import (
    apply_regional_compile,
    check_compile,
    compile_regions,
    compiled_graphs,
    normalize_compile,
)
from torch import nn

FRAME_LEVELS = 2
AUDIO_TOL = 1e-6


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return Settings(cache_dir=str(tmp_path_factory.mktemp("cache")))


def engine(settings, model, **options):
    return Engine(model, host=PluginHost(settings), settings=settings, **options)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


def test_normalize_compile():
    assert normalize_compile(True) == normalize_compile("blocks") == "blocks"
    assert normalize_compile(False) == normalize_compile(None) == normalize_compile("none") == "none"
    with pytest.raises(InvalidRequest, match="compile: must be one of"):
        normalize_compile("everything")


@pytest.mark.parametrize("kwargs,match", [
    ({"offload": "layerwise"}, "cannot be combined with --offload layerwise"),
    ({"offload": "model"}, "cannot be combined with --offload model"),
    ({"parallel": True}, "with --parallel is not supported yet"),
])
def test_check_compile_refuses_combinations_with_the_reason(kwargs, match):
    args = {"model": "m", "platform": "cpu", "offload": "none", "parallel": False, **kwargs}
    with pytest.raises(UnsupportedFeature, match=match):
        check_compile("blocks", **args)
    check_compile("none", **args)  # eager: nothing to refuse


def test_cuda_graphs_need_the_cuda_platform():
    with pytest.raises(UnsupportedFeature, match="needs the cuda platform"):
        check_compile("blocks-cudagraphs", model="m", platform="cpu", offload="none", parallel=False)
    check_compile("blocks-cudagraphs", model="m", platform="cuda", offload="none", parallel=False)


def test_regions_come_from_the_declaration_or_the_block_loop():
    loop = SimpleNamespace(blocks="transformer.blocks")
    assert compile_regions(SimpleNamespace(block_loop=loop)) == ("transformer.blocks",)
    assert compile_regions(SimpleNamespace(block_loop=loop, compile_regions=("a.blocks", "b.blocks"))) == (
        "a.blocks", "b.blocks")
    assert compile_regions(SimpleNamespace()) == ()


def test_apply_compiles_each_block_in_place_through_mappings_and_remove_restores_eager():
    dits = {"fl2va": SimpleNamespace(blocks=nn.ModuleList([Block(), Block()])),
            "ref2va": SimpleNamespace(blocks=nn.ModuleList([Block()]))}
    pipeline = SimpleNamespace(transformers=dits, compile_regions=("transformers.fl2va.blocks",
                                                                    "transformers.ref2va.blocks"))
    handle = apply_regional_compile(pipeline, "blocks")
    blocks = [*dits["fl2va"].blocks, *dits["ref2va"].blocks]
    assert handle.blocks == blocks and handle.classes == ("Block",)
    assert all(b._compiled_call_impl is not None for b in blocks)
    handle.remove()
    assert all(b._compiled_call_impl is None for b in blocks) and handle.blocks == []


def test_a_wrong_region_or_a_model_without_regions_is_refused_naming_it():
    with pytest.raises(UnsupportedFeature, match="'nope.blocks' does not name an attribute"):
        apply_regional_compile(SimpleNamespace(compile_regions=("nope.blocks",)), "blocks")
    with pytest.raises(UnsupportedFeature, match="declares no compile regions"):
        apply_regional_compile(SimpleNamespace(spec=SimpleNamespace(name="toy")), "blocks")


def test_engine_refuses_compile_with_offload_before_loading(settings, monkeypatch):
    import omnicore.engine.api as api

    def must_not_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(api, "load_pipeline", must_not_load)
    with pytest.raises(UnsupportedFeature, match="--offload layerwise"):
        engine(settings, "tiny:lingbot", compile=True, offload="layerwise")


def test_cli_flag():
    parser = build_parser()
    base = ["generate", "tiny:lingbot", "a fox", "-o", "fox.png"]
    assert parser.parse_args(base).compile == "none"
    assert parser.parse_args([*base, "--compile"]).compile == "blocks"
    assert parser.parse_args([*base, "--compile", "blocks-cudagraphs"]).compile == "blocks-cudagraphs"


@pytest.mark.slow
def test_blocks_of_one_class_share_their_graphs():
    """Eight blocks, one class: compiling costs at most two graphs (the first block's, then one that no longer
    specialises on the block), not eight — the count does not grow with depth."""
    torch._dynamo.reset()
    pipeline = SimpleNamespace(blocks=nn.ModuleList([Block() for _ in range(8)]), compile_regions=("blocks",))
    handle = apply_regional_compile(pipeline, "blocks")
    x = torch.randn(4, 8)
    before = compiled_graphs()
    y = x
    for block in pipeline.blocks:
        y = block(y)
    assert compiled_graphs() - before <= 2
    handle.remove()
    z = x
    for block in pipeline.blocks:
        z = block(z)
    torch.testing.assert_close(y, z)


def _frames(out) -> np.ndarray:
    return np.asarray(out.frames, dtype=np.int16)


@pytest.mark.slow
def test_lingbot_compiled_equals_eager_within_tolerance(settings):
    kw = dict(height=64, width=64, num_frames=5, num_inference_steps=2, seed=0)
    with engine(settings, "tiny:lingbot") as eng:
        ref = eng.generate("a red fox", **kw)[0]
    with engine(settings, "tiny:lingbot", compile=True) as eng:
        assert eng.compile_handle is not None and eng.compile_handle.classes == ("LingBotBlock",)
        out = eng.generate("a red fox", **kw)[0]
        graphs = compiled_graphs()
        again = eng.generate("a red fox", **kw)[0]
        assert compiled_graphs() == graphs  # the same shape compiles nothing new
    assert np.abs(_frames(out) - _frames(ref)).max() <= FRAME_LEVELS
    assert np.array_equal(_frames(out), _frames(again))


@pytest.mark.slow
def test_minimax_h3_compiled_with_the_adaln_cache_equals_eager(settings):
    kw = dict(num_inference_steps=3, height=64, width=64, duration=4.0, seed=5, extra={"aspect_ratio": "1:1"})
    with engine(settings, "tiny:minimax-h3") as eng:
        ref = eng.generate("rain on a tin roof", **kw)[0]
    with engine(settings, "tiny:minimax-h3", compile=True, cache_methods=["adaln_schedule"]) as eng:
        out = eng.generate("rain on a tin roof", **kw)[0]
    assert np.abs(_frames(out) - _frames(ref)).max() <= FRAME_LEVELS
    assert np.abs(np.asarray(out.audio) - np.asarray(ref.audio)).max() <= AUDIO_TOL


@pytest.mark.slow
def test_hunyuan_compiled_equals_eager_within_tolerance(settings):
    kw = dict(num_inference_steps=2, seed=1)
    with engine(settings, "tiny:hunyuan-image3") as eng:
        ref = eng.generate("a cat", **kw)[0]
    with engine(settings, "tiny:hunyuan-image3", compile=True) as eng:
        assert eng.compile_handle is not None and eng.compile_handle.classes == ("DecoderLayer",)
        out = eng.generate("a cat", **kw)[0]
    assert np.abs(_frames(out) - _frames(ref)).max() <= FRAME_LEVELS


def test_warmup_request_is_the_default_text_request_with_required_examples(settings):
    from omnicore.engine.loading import find_preset, preset_spec
    from omnicore.engine.warmup import warmup_request

    host = PluginHost(settings)
    h3 = preset_spec(*find_preset(host, "tiny:minimax-h3"))
    req = warmup_request(h3)
    assert req.params.num_inference_steps == 1 and req.params.output_type == "video"
    assert req.extra == {"aspect_ratio": "16:9"} or set(req.extra) == {"aspect_ratio"}
    ref_only = find_preset(host, "tiny:minimax-h3-ref2va")[1]
    with pytest.raises(UnsupportedFeature, match="serves only conditioned modes"):
        warmup_request(h3, ref_only.modes)


@pytest.mark.slow
def test_warmup_pays_the_compile_at_start_up(settings):
    """With --compile --warmup the first real request of the default shape compiles nothing new."""
    with engine(settings, "tiny:lingbot", compile=True, warmup=True) as eng:
        assert eng.warmup_s is not None and eng.warmup_s > 0
        graphs = compiled_graphs()
        spec = eng.spec
        eng.generate("a red fox", num_inference_steps=2, seed=1,
                     output_type="image" if spec.capabilities.modes[0].endswith("i") else "video")
        assert compiled_graphs() == graphs
