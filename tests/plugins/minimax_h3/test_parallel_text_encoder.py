"""MiniMax-H3's Qwen3-VL text encoder under ``--parallel tp=2`` (gloo, 2 processes): the decoder's attention (whole
K/V heads per rank) and MLP linears are split over the ranks, each rank reads only its rows of the safetensors file
(and nothing of the LM head or the layers past the readout), and the layer-49 readout equals the single-process
encoder's within fp32 tolerance, with and without a keyframe (vision tower and DeepStack replicated). A degree the
head counts do not divide is refused before anything is read, naming the numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omnicore.errors import ConfigError

LAYER = 50  # the tiny preset's readout layer (the release's)


def _stored_bytes(folder: Path, plan: Any, layers: int) -> tuple[int, int]:
    """(bytes of the stored tensors the encoder needs, bytes of those the plan splits), from the file headers."""
    from safetensors import safe_open

    total = split = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                parts = name.split(".")
                if not name.startswith("model.") or (parts[1:3] == ["language_model", "layers"]
                                                     and int(parts[3]) >= layers):
                    continue  # the LM head and the layers past the readout are never read
                t = f.get_slice(name)
                n = int(np.prod(t.get_shape())) * {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()]
                total += n
                module, _, param = name.rpartition(".")
                split += n if plan.param_split(module, param) is not None else 0
    return total, split


@pytest.mark.slow  # two spawned processes importing torch + transformers
def test_tp_text_encoder_equals_the_single_process_one_and_each_rank_reads_its_share(tiny_dir: Path,
                                                                                       tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from _h3_text_ranks import encodings, h3_text_rank
    from omni_minimax_h3.text_encoder import H3TextEncoder
    from omnicore.plugin import qwen3_vl_tp_plan, sharded_parameter_bytes

    mp.spawn(h3_text_rank, args=(str(tmp_path / "rendezvous"), str(tiny_dir), str(tmp_path), LAYER), nprocs=2,
             join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    whole = H3TextEncoder.from_pretrained(tiny_dir / "text_encoder", tiny_dir / "tokenizer", tiny_dir / "processor",
                                          device="cpu", dtype=torch.float32, layer=LAYER)
    expected = encodings(whole)
    text = whole.model.config.text_config
    assert text.num_key_value_heads < text.num_attention_heads  # grouped-query, as released
    plan = qwen3_vl_tp_plan(text)
    for got in ranks:
        assert len(got["rows"]) == len(expected) == 2
        for (rows, tags), (want, want_tags) in zip(got["rows"], expected):
            assert torch.equal(tags, want_tags) and rows.shape == want.shape
            torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
    for r, got in enumerate(ranks):
        # rank r holds query heads r*H/2 ... and whole K/V heads r*K/2 ... (the rows of the heads that share them)
        attn = whole.model.language_model.layers[0].self_attn
        q_rows, k_rows = text.num_attention_heads // 2 * text.head_dim, text.num_key_value_heads // 2 * text.head_dim
        assert torch.equal(got["q"], attn.q_proj.weight[r * q_rows:(r + 1) * q_rows])
        assert torch.equal(got["k"], attn.k_proj.weight[r * k_rows:(r + 1) * k_rows])
        # one all-reduce per attention and per MLP of every layer read, per encode
        assert got["all_reduce"] == 2 * LAYER * len(expected)
        # resident bytes: the analytic share of the whole encoder; bytes read: the needed tensors less half the
        # split rows (nothing of the LM head or of layers >= LAYER)
        assert got["held"] == sharded_parameter_bytes(whole.model, plan, 2) < sum(
            p.numel() * p.element_size() for p in whole.model.parameters())
        total, split = _stored_bytes(tiny_dir / "text_encoder", plan, LAYER)
        assert split > 0 and got["read"] == total - split // 2


@pytest.mark.parametrize(("degree", "what", "count"), [(3, "attention heads", 8), (8, "key/value heads", 4)])
def test_a_degree_the_text_encoder_heads_do_not_divide_is_refused_before_reading(tiny_dir: Path, degree: int,
                                                                                  what: str, count: int) -> None:
    from omnicore.plugin import load_qwen3_vl

    with pytest.raises(ConfigError, match=rf"tp={degree} must divide the model's text-encoder {what} \({count}\)"):
        load_qwen3_vl(tiny_dir / "text_encoder", tiny_dir / "tokenizer", tiny_dir / "processor", device="cpu",
                      dtype=torch.float32, layers=LAYER, tp=(0, degree))
