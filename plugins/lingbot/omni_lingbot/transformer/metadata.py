"""Per-forward metadata of the LingBot DiT, built once per request branch.

Everything a forward derives from shapes and the text mask alone — the packed layout (segments, attention metadata,
padding rows), the RoPE positions and their complex frequencies, and where the real text tokens sit — is the same
at every denoise step of one request branch. Building it reads the mask on the host (a device sync), gathers RoPE
tables and allocates small device tensors; :class:`ForwardMetadata` keeps the result so a caller can build it once
and hand it to every later forward. The forward runs the same code on the same tensors either way, so outputs are
bit-identical with and without reuse.

The record is keyed by host-side facts only (latent shape, text batch shape, padding multiple, device), so checking
that it fits a call never touches device memory. The *contents* of the text mask are not re-checked per call (that
would sync): a record must be used with the mask it was built from.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from .layout import JointLayout


@attrs.frozen(eq=False)
class ForwardMetadata:
    """What one forward needs besides the activations: layout, RoPE frequencies and the real-text row index."""

    layout: JointLayout
    freqs: torch.Tensor  # [T, head_dim // 2] complex64, one row per packed row (padding rows included)
    text_rows: torch.Tensor | None  # int64 flat indices of the real tokens in [B * L]; None = every token is real
    latent_shape: tuple[int, ...]  # (B, C, F, H, W) of the hidden states it was built for
    text_shape: tuple[int, int]  # (B, L) of the text batch it was built for
    pad_to_multiple: int
    device: torch.device

    def mismatch(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, pad_to_multiple: int | None = None
    ) -> str | None:
        """Why this record does not fit these inputs (host-side shape/device checks only), or None if it does."""
        if tuple(hidden_states.shape) != self.latent_shape:
            return f"latent shape {tuple(hidden_states.shape)} != {self.latent_shape}"
        if tuple(encoder_hidden_states.shape[:2]) != self.text_shape:
            return f"text batch shape {tuple(encoder_hidden_states.shape[:2])} != {self.text_shape}"
        if hidden_states.device != self.device:
            return f"device {hidden_states.device} != {self.device}"
        if pad_to_multiple is not None and pad_to_multiple != self.pad_to_multiple:
            return f"pad_to_multiple {pad_to_multiple} != {self.pad_to_multiple}"
        return None

    def matches(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, pad_to_multiple: int | None = None
    ) -> bool:
        return self.mismatch(hidden_states, encoder_hidden_states, pad_to_multiple) is None

    def real_text(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[B, L, D]`` -> ``[Σ L_i, D]``: the real tokens, sample by sample (row-major order of the mask)."""
        flat = encoder_hidden_states.reshape(-1, encoder_hidden_states.shape[-1])
        return flat if self.text_rows is None else flat.index_select(0, self.text_rows)

    @property
    def nbytes(self) -> int:
        """Device bytes this record keeps alive (what reuse costs per branch)."""
        layout = self.layout
        tensors = [self.freqs, self.text_rows, layout.positions, layout.token_mask]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def build_forward_metadata(
    patch_size: tuple[int, int, int],
    rope: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor | None = None,
    pad_to_multiple: int = 1,
) -> ForwardMetadata:
    """The metadata of a forward on these inputs; only shapes, the device and the mask's contents are read."""
    b, _, f, h, w = hidden_states.shape
    pf, ph, pw = patch_size
    if f % pf or h % ph or w % pw:
        raise ValueError(f"latent (F={f}, H={h}, W={w}) is not divisible by patch_size {tuple(patch_size)}")
    device = hidden_states.device
    text_len = encoder_hidden_states.shape[1]
    text_rows = None
    if encoder_attention_mask is None:
        lengths = [text_len] * b
    else:
        real = encoder_attention_mask.to(torch.bool)
        lengths = [int(n) for n in real.sum(dim=1).tolist()]
        if sum(lengths) != b * text_len:
            text_rows = real.reshape(-1).nonzero().squeeze(1).to(device)
    layout = JointLayout.build((f // pf, h // ph, w // pw), lengths, device, pad_to_multiple)
    return ForwardMetadata(layout=layout, freqs=rope(layout.positions), text_rows=text_rows,
                           latent_shape=tuple(hidden_states.shape), text_shape=(b, text_len),
                           pad_to_multiple=pad_to_multiple, device=device)
