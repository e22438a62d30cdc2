"""Request-gated VAE fast paths and the decode precision (docs/contracts-status.md C7.1, C7.2, C7.4): the gate's nesting, the
runner turning it on only for ``quality == "high"`` batches, never for a mixed batch, installation invariants, compile
safety, and the decoder-only precision with the core's validation."""

from __future__ import annotations

import copy

import pytest
import torch
from omnicore.engine.protocol import LoadOptions
from omnicore.errors import ConfigError
from omnicore.platforms.cpu import CpuPlatform
from omnicore.vae_fast_paths import (
    FastPathGate,
    apply_decode_precision,
    fast_path_gate,
    install_fast_path,
    pipeline_gates,
    request_fast_paths,
    uninstall_fast_path,
)
from torch import nn


class ToyVAE(nn.Module):
    """encoder / quant_conv / post_quant_conv / decoder, like diffusers' KL VAEs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU())
        self.quant_conv = nn.Conv2d(8, 8, 1)
        self.post_quant_conv = nn.Conv2d(4, 4, 1)
        self.decoder = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(),
                                     nn.Conv2d(8, 3, 3, padding=1))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_conv(self.encoder(x))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z))


def test_gate_is_off_by_default_and_nesting_restores_the_previous_state():
    gate = FastPathGate()
    seen = [gate.enabled]
    with gate(True):
        seen.append(gate.enabled)
        with gate(False):
            seen.append(gate.enabled)
        seen.append(gate.enabled)
    seen.append(gate.enabled)
    assert seen == [False, True, False, True, False]
    with pytest.raises(KeyError), gate(True):
        raise KeyError("x")
    assert gate.enabled is False  # restored on an exception too


@pytest.mark.parametrize(("quality", "enabled"), [("high", True), ("standard", False), ("draft", False),
                                                  (None, False), ("lossless", False)])
def test_the_request_gate_is_on_only_for_high_quality(quality, enabled):
    class Pipe:
        vae = ToyVAE()

    gate = fast_path_gate(Pipe.vae)
    with request_fast_paths(Pipe(), quality) as on:
        assert on is enabled and gate.enabled is enabled
    assert gate.enabled is False


def test_the_gates_are_on_only_when_every_request_asks_for_high():
    """The scheduler keeps quality levels apart (test_engine's test_mixed_quality_is_never_batched); the gate
    itself only reads the level."""
    class Pipe:
        vae = ToyVAE()

    with request_fast_paths(Pipe(), {"high", "standard"}) as on:
        assert not on and fast_path_gate(Pipe.vae).enabled is False
    with request_fast_paths(Pipe(), {"high"}) as on:  # one level, many requests
        assert on and fast_path_gate(Pipe.vae).enabled is True


def test_a_pipeline_without_gates_is_untouched():
    class Pipe:
        vae = ToyVAE()

    assert pipeline_gates(Pipe()) == []  # looking never creates a gate
    with request_fast_paths(Pipe(), "high"):
        pass
    assert fast_path_gate(Pipe.vae, create=False) is None


def test_the_engine_enters_the_gate_once_around_each_batch(tmp_path):
    from toy import toy_engine

    with toy_engine(tmp_path) as engine:
        pipe = engine.pipeline
        pipe.vae = ToyVAE()
        gate = fast_path_gate(pipe.vae)
        seen: list[tuple[str, bool]] = []
        encode, decode = pipe.encode, pipe.decode
        pipe.encode = lambda reqs: seen.append(("encode", gate.enabled)) or encode(reqs)
        pipe.decode = lambda state: seen.append(("decode", gate.enabled)) or decode(state)
        for quality in ("high", "standard"):
            engine.generate("a cat", quality=quality, num_inference_steps=1)
        assert seen == [("encode", True), ("decode", True), ("encode", False), ("decode", False)]
    assert gate.enabled is False  # the worker left the batch's gate (results are delivered inside it)


def test_installation_keeps_names_state_dict_and_is_bit_exact_with_the_gate_off():
    vae, plain = ToyVAE(), ToyVAE()
    gate = fast_path_gate(vae)
    calls = []
    norm, act = vae.decoder[1], vae.decoder[2]
    fast = lambda x: calls.append(1) or torch.nn.functional.silu(type(norm).forward(norm, x))  # noqa: E731
    for _ in range(2):  # idempotent
        install_fast_path(norm, fast, gate)
        install_fast_path(act, lambda x: x, gate)
    assert [n for n, _ in vae.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert vae.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(vae.state_dict(), strict=True)
    assert all(p.is_contiguous() for p in vae.parameters())
    z = torch.randn(1, 4, 6, 6)
    assert torch.equal(vae.decode(z), plain.decode(z)) and calls == []  # gate off: the original modules
    with gate(True):
        on = vae.decode(z)
    assert calls == [1]
    torch.testing.assert_close(on, plain.decode(z), atol=5e-4, rtol=1e-4)
    twin = copy.deepcopy(vae)  # the gate and the switch survive a copy (the fast forward is the model's to redo)
    assert torch.equal(twin.decode(z), plain.decode(z)) and calls == [1]
    assert fast_path_gate(twin, create=False) is not None
    uninstall_fast_path(norm)
    with gate(True):
        vae.decoder[1](torch.randn(1, 8, 2, 2))
    assert calls == [1]


def test_while_compiling_the_original_forward_runs(monkeypatch):
    module = nn.Identity()
    gate = FastPathGate()
    install_fast_path(module, lambda x: x + 1, gate)
    x = torch.zeros(2)
    with gate(True):
        assert torch.equal(module(x), x + 1)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert torch.equal(module(x), x)


# ---------------------------------------------------------------------------------------------- vae_decode_precision
@pytest.mark.parametrize("bad", ["int8", "fp8", 16, "float"])
def test_invalid_decode_precisions_are_rejected_naming_the_field(bad):
    checks = (lambda: apply_decode_precision(ToyVAE(), bad),
              lambda: LoadOptions(platform=CpuPlatform(), vae_decode_precision=bad))
    for check in checks:
        with pytest.raises(ValueError, match=r"vae_decode_precision.*must be one of.*fp32.*fp16.*bf16.*or None") as \
                info:
            check()
        assert isinstance(info.value, ConfigError)
        shape = "vae_decode_precision: must be one of {'fp32', 'fp16', 'bf16'} or None, got "
        assert str(info.value) == shape + repr(bad)


def test_bf16_round_trips_and_only_the_decoder_side_changes_dtype():
    assert LoadOptions(platform=CpuPlatform(), vae_decode_precision="bf16").vae_decode_precision == "bf16"
    vae = ToyVAE()
    ref = copy.deepcopy(vae)
    assert apply_decode_precision(vae, "bf16") is torch.bfloat16
    assert apply_decode_precision(vae, "bf16") is torch.bfloat16  # again: one cast hook, not two
    assert {p.dtype for p in vae.decoder.parameters()} == {p.dtype for p in vae.post_quant_conv.parameters()} == {
        torch.bfloat16}
    assert {p.dtype for p in vae.encoder.parameters()} == {p.dtype for p in vae.quant_conv.parameters()} == {
        torch.float32}
    z = torch.randn(1, 4, 6, 6)
    out = vae.decode(z)  # fp32 latents in, decode dtype out
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.decode(z), atol=0.1, rtol=0.05)
    latents = vae.encode(torch.randn(1, 3, 6, 6).bfloat16())  # a bf16 image encodes to fp32 latents
    assert latents.dtype == torch.float32
    assert apply_decode_precision(vae, None) is None and vae.decode(z.bfloat16()).dtype == torch.bfloat16
    assert apply_decode_precision(vae, "fp32") is torch.float32 and vae.decode(z.half()).dtype == torch.float32
