"""``omnicore.integrations.qwen3_vl``: the Qwen3-VL text-encoder loader and the tiny one LingBot and MiniMax-H3 share.

Random weights: the encoder's outputs are noise; these tests check the layout, the ids, the loaded modules and the
layer truncation, never what the embeddings mean.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omnicore.plugin import QWEN_SPECIAL_TOKENS, build_tiny_qwen3_vl, load_qwen3_vl  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("qwen3vl")
    ids = build_tiny_qwen3_vl(root / "text_encoder", root / "processor", 5, tokenizer_dir=root / "tokenizer",
                              layers=3)
    return root, ids


def test_writes_the_release_layout_and_returns_the_special_ids(tiny: tuple[Path, dict[str, int]]) -> None:
    root, ids = tiny
    assert (root / "text_encoder" / "config.json").is_file() and (root / "text_encoder" / "model.safetensors").is_file()
    assert (root / "tokenizer" / "tokenizer.json").is_file() and (root / "processor" / "tokenizer.json").is_file()
    assert (root / "processor" / "preprocessor_config.json").is_file()
    assert set(QWEN_SPECIAL_TOKENS) <= set(ids) and ids["__vocab_size__"] == 256 + len(QWEN_SPECIAL_TOKENS)
    assert sorted(ids[t] for t in QWEN_SPECIAL_TOKENS) == list(range(256, 256 + len(QWEN_SPECIAL_TOKENS)))


def test_the_same_seed_writes_the_same_weights(tmp_path: Path, tiny: tuple[Path, dict[str, int]]) -> None:
    root, _ = tiny
    build_tiny_qwen3_vl(tmp_path / "te", tmp_path / "proc", 5, layers=3)
    assert (tmp_path / "te" / "model.safetensors").read_bytes() == (root / "text_encoder" /
                                                                    "model.safetensors").read_bytes()


def test_loads_the_inner_model_frozen_with_its_tokenizer_and_processor(tiny: tuple[Path, dict[str, int]]) -> None:
    root, ids = tiny
    model, tokenizer, processor = load_qwen3_vl(root / "text_encoder", root / "tokenizer", root / "processor",
                                                device="cpu", dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3VLModel" and not model.training
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in model.parameters())
    assert len(model.language_model.layers) == 3
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == ids["<|image_pad|>"]
    assert int(processor.merge_size) == 2


def test_layers_loads_only_the_first_decoder_layers(tiny: tuple[Path, dict[str, int]]) -> None:
    root, _ = tiny
    full, _, _ = load_qwen3_vl(root / "text_encoder", root / "processor", device="cpu", dtype=torch.float32)
    cut, _, _ = load_qwen3_vl(root / "text_encoder", root / "processor", device="cpu", dtype=torch.float32,
                              layers=2)
    assert len(cut.language_model.layers) == 2
    for a, b in zip(cut.language_model.layers.parameters(), full.language_model.layers[:2].parameters(),
                    strict=True):
        assert torch.equal(a, b)  # the kept layers hold the checkpoint's weights, not fresh ones
    with pytest.raises(ValueError, match="3 decoder layers, 4 asked for"):
        load_qwen3_vl(root / "text_encoder", root / "processor", device="cpu", dtype=torch.float32, layers=4)
