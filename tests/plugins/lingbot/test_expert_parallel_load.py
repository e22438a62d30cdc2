"""LingBot MoE's expert-parallel load (``--parallel ep=N``): each rank builds the DiT on the meta device, narrows every
MoE block to its contiguous share of the routed experts and reads only those experts' rows from the safetensors
(router, shared experts and every dense weight whole). Checked per rank without a process group (the load needs
only the rank's coordinates): the bytes read and the parameter bytes held equal the analytic share, and the experts
held are the checkpoint's own experts ``[r E/P, (r+1) E/P)``. The single-process load (meta build, tensors taken
over) equals a DiT initialised at random and then loaded, value for value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _worker_group_helpers import planned_file_bytes
from omni_lingbot.loader import WEIGHTS_NAME, expert_read_plan, load_transformer
from omnicore.errors import ConfigError
from omnicore.plugin import local_parameter_bytes
from safetensors import safe_open

EXPERTS = (".ffn.experts.w1", ".ffn.experts.w3", ".ffn.experts.w2")


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _load(folder: Path, ep: tuple[int, int] | None = None) -> torch.nn.Module:
    return load_transformer(folder, device=torch.device("cpu"), dtype=torch.float32, ep=ep)


def test_single_process_load_equals_a_randomly_initialised_dit_loaded_after(tiny_moe_dir: Path) -> None:
    from omni_lingbot.transformer.config import LingBotTransformerConfig
    from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel
    from omnicore.checkpoint import read_json

    folder = tiny_moe_dir / "transformer"
    reference = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(read_json(folder / "config.json",
                                                                                            plugin="lingbot")))
    reference.load_state_dict(_checkpoint(folder), strict=True)
    model = _load(folder)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    expected = reference.state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    torch.manual_seed(0)
    cfg = model.config
    latents, text = torch.randn(1, cfg.in_channels, 2, 8, 8), torch.randn(1, 6, cfg.text_dim)
    t = torch.tensor([500.0])
    with torch.no_grad():
        assert torch.equal(model(latents, t, text), reference.eval()(latents, t, text))


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_reads_and_holds_only_its_experts(tiny_moe_dir: Path, rank: int) -> None:
    folder = tiny_moe_dir / "transformer"
    full = _checkpoint(folder)
    degree = 2
    total, routed_bytes = planned_file_bytes(folder, expert_read_plan())  # from the headers, as for tp
    routed = {k: t for k, t in full.items() if k.endswith(EXPERTS)}
    assert routed and routed_bytes == sum(t.numel() * t.element_size() for t in routed.values()) > 0
    model = _load(folder, ep=(rank, degree))
    share = total - routed_bytes + routed_bytes // degree
    assert model.tp_bytes_read == share  # the other rank's experts never left the file
    buffers = sum(t.numel() * t.element_size() for k, t in full.items() if k.endswith("e_score_correction_bias"))
    params = total - buffers  # the routers' correction biases are buffers, every other tensor a parameter
    assert local_parameter_bytes(model) == params - routed_bytes + routed_bytes // degree
    state = model.state_dict()
    for name, tensor in routed.items():
        per = tensor.shape[0] // degree
        assert torch.equal(state[name], tensor[rank * per:(rank + 1) * per]), name
    for name, tensor in full.items():
        if name not in routed:
            assert torch.equal(state[name], tensor), name
    firsts = {m.first for m in model.modules() if type(m).__name__ == "MoEExperts"}
    assert firsts == {rank * model.config.num_experts // degree}


def test_an_expert_degree_the_experts_refuse_fails_before_reading(tiny_moe_dir: Path, tiny_dir: Path) -> None:
    experts = _load(tiny_moe_dir / "transformer").config.num_experts
    with pytest.raises(ConfigError, match=rf"ep=3 must divide the model's routed experts \({experts}\)"):
        _load(tiny_moe_dir / "transformer", ep=(0, 3))
    with pytest.raises(ConfigError, match="ep=2 needs a mixture-of-experts DiT"):
        _load(tiny_dir / "transformer", ep=(1, 2))
