"""omnicore.tiny_checkpoints: seeded visible weight init and the merge-free byte-level tokenizer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omnicore.tiny_checkpoints import byte_level_tokenizer, init_visible_weights


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 48)
        self.conv = torch.nn.Conv2d(8, 16, kernel_size=3)
        self.norm_out = torch.nn.LayerNorm(48)
        self.table = torch.nn.Parameter(torch.zeros(6, 48))


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_same_seed_same_weights_other_seed_differs_and_global_rng_untouched() -> None:
    a, b, c = _Tiny(), _Tiny(), _Tiny()
    state = torch.random.get_rng_state()
    init_visible_weights(a, 7)
    assert torch.equal(state, torch.random.get_rng_state())
    init_visible_weights(b, 7)
    init_visible_weights(c, 8)
    sa, sb, sc = _snapshot(a), _snapshot(b), _snapshot(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(torch.equal(sa[k], sc[k]) for k in sa)


def test_init_rules() -> None:
    torch.manual_seed(0)
    m = _Tiny()
    init_visible_weights(m, 3, gain=2.0)
    # matrices: std ~ gain / sqrt(fan_in), fan_in = elements per output row (conv: 8 * 3 * 3)
    assert m.proj.weight.std().item() == pytest.approx(2.0 / math.sqrt(64), rel=0.1)
    assert m.conv.weight.std().item() == pytest.approx(2.0 / math.sqrt(72), rel=0.1)
    assert m.table.std().item() == pytest.approx(2.0 / math.sqrt(48), rel=0.15)
    # norm weights centred on 1, every other vector ~ 0.1 noise around 0
    assert m.norm_out.weight.mean().item() == pytest.approx(1.0, abs=0.05)
    assert 0.05 < m.norm_out.weight.std().item() < 0.15
    for vec in (m.norm_out.bias, m.proj.bias, m.conv.bias):
        assert vec is not None
        assert abs(vec.mean().item()) < 0.1
        assert 0.04 < vec.std().item() < 0.18
    # the hooks: own fan-in, own norm test, plain rule for named tables
    init_visible_weights(m, 3, fan_in=lambda name, p: 4, is_norm_weight=lambda name, p: False,
                         is_plain=lambda name, p: name == "table")
    assert m.proj.weight.std().item() == pytest.approx(0.5, rel=0.1)
    assert abs(m.norm_out.weight.mean().item()) < 0.05
    assert m.table.std().item() == pytest.approx(0.1, rel=0.15)


def test_the_first_parameter_in_name_order_is_the_first_draw() -> None:
    m = _Tiny()
    init_visible_weights(m, 11)
    expected = torch.randn((16,), generator=torch.Generator().manual_seed(11))  # conv.bias sorts first
    assert m.conv.bias is not None
    assert torch.equal(m.conv.bias, 0.1 * expected)


def test_byte_level_tokenizer_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    written = byte_level_tokenizer(tmp_path / "tok", specials, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", model_max_length=4096)
    assert written.path == tmp_path / "tok"
    assert dict(written.special_ids) == {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    assert written.vocab_size == 259

    tok = AutoTokenizer.from_pretrained(str(written.path))
    text = "Grüße, 世界! \t tabs\nand émoji 🎬 <b>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok("<|im_start|>hi<|im_end|>", add_special_tokens=False)["input_ids"] == [257, ids_of(tok, "h"),
                                                                                      ids_of(tok, "i"), 258]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (258, 256, 257)
    assert tok.model_max_length == 4096


def ids_of(tok: object, char: str) -> int:
    encoded = tok(char, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert len(encoded) == 1
    return int(encoded[0])


def test_named_tokens_must_be_special(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eos_token"):
        byte_level_tokenizer(tmp_path, ("<pad>",), eos_token="</s>", pad_token="<pad>")
