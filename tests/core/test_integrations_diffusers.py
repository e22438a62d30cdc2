"""``omnicore.integrations.diffusers``: diffusers attention modules run the backend omnicore selects, with the same
numbers as diffusers' own processor (self- and cross-attention with a padding mask, and a VAE's 4-D attention)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from omnicore.attention.reference import sdpa_attention
from omnicore.engine.protocol import LoadOptions
from omnicore.integrations.diffusers import SelectedAttention, route_diffusers_attention
from omnicore.platforms.cpu import CpuPlatform
from omnicore.specs import AttentionRequirement


def _Options(attention: Any = None) -> LoadOptions:
    """The options a pipeline's ``from_pretrained`` gets, on the CPU platform, with ``attention`` as the selector."""
    return LoadOptions(platform=CpuPlatform(), attention=attention)


class Recorder:
    """An attention selector: records each requirement, returns a counting wrapper of the SDPA reference."""

    def __init__(self) -> None:
        self.requirements: list[AttentionRequirement] = []
        self.calls = 0
        self.masks: list[Any] = []

    def __call__(self, requirement: AttentionRequirement) -> Any:
        self.requirements.append(requirement)

        def backend(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.masks.append(kwargs.get("attn_mask"))
            return sdpa_attention(q, k, v, **kwargs)

        return backend


def _pixart() -> Any:
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    return PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                    num_layers=2, cross_attention_dim=16, caption_channels=16, sample_size=8,
                                    patch_size=2, norm_num_groups=4, interpolation_scale=1).eval()


def _run(model: Any, mask: Any) -> Any:
    gen = torch.Generator().manual_seed(1)
    x, text = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 5, 16, generator=gen)
    with torch.no_grad():
        return model(x, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=torch.tensor([10, 900]),
                     added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]


def test_transformer_attention_matches_diffusers_and_calls_the_selected_backend() -> None:
    model = _pixart()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    expected = _run(model, mask)
    selector = Recorder()
    assert route_diffusers_attention(model, _Options(attention=selector)) == 4  # 2 blocks x (self, cross)
    actual = _run(model, mask)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert selector.calls == 4 and len(selector.requirements) == 1  # one requirement per (dtype, head dim)
    assert selector.requirements[0] == AttentionRequirement(platform="cpu", dtype="float32", head_dim=8)
    cross = [m for m in selector.masks if m is not None]
    assert len(cross) == 2 and all(m.dtype == torch.bool for m in cross)
    assert cross[0][1].flatten().tolist() == [True, True, False, False, False]  # padding keys are masked


def test_the_mask_reaches_the_backend() -> None:
    model = _pixart()
    route_diffusers_attention(model, _Options(attention=Recorder()))
    full, padded = _run(model, torch.ones(2, 5)), _run(model, torch.tensor([[1] * 5, [1, 1, 0, 0, 0]]))
    torch.testing.assert_close(full[0], padded[0])  # row 0 sees the same keys
    assert not torch.allclose(full[1], padded[1])  # row 1 lost three keys


def test_vae_attention_4d_with_group_norm_and_residual() -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4).eval()
    z = torch.randn(1, 4, 6, 6)
    with torch.no_grad():
        expected = vae.decode(z).sample
        selector = Recorder()
        assert route_diffusers_attention(vae, _Options(attention=selector)) == 2  # encoder and decoder mid-blocks
        actual = vae.decode(z).sample
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert selector.calls == 1 and selector.requirements[0].head_dim == 16


def test_nothing_routed_without_a_selector_and_custom_processors_left_alone() -> None:
    model = _pixart()
    assert route_diffusers_attention(model, _Options(attention=None)) == 0
    route_diffusers_attention(model, _Options(attention=Recorder()))
    assert all(isinstance(p, SelectedAttention) for p in model.attn_processors.values())
    assert route_diffusers_attention(model, _Options(attention=Recorder())) == 0  # already routed: not plain
