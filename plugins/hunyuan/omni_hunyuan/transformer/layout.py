"""The token layout of one request and the paged-KV request records (docs/contracts-status.md C5).

A :class:`SequenceLayout` holds the token rows (``[cond]`` or ``[cond, uncond]``; the ``<cfg>`` substitution
keeps rows equally long, so they share every index) and where each section sits: the generated image's
``<timestep>``/``<img>`` run, each condition image's joint (VAE + ViT) section, and the bidirectional spans.
Everything is host-side ints, so two layouts compare field by field.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

from .rope import positions_2d


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


@attrs.frozen
class CondSection:
    """One condition image inside the user turn: ``<boi> <size> <ratio> <timestep> <img>*vae <sep> <img>*vit <eoi>``."""

    timestep: int
    vae_start: int
    vae_h: int
    vae_w: int
    vit_start: int
    vit_h: int
    vit_w: int

    @property
    def vae_end(self) -> int:
        return self.vae_start + self.vae_h * self.vae_w

    @property
    def vit_end(self) -> int:
        return self.vit_start + self.vit_h * self.vit_w

    @property
    def joint_span(self) -> tuple[int, int]:
        return (self.vae_start, self.vit_end)


@attrs.frozen
class SequenceLayout:
    tokens: tuple[tuple[int, ...], ...]
    template: str
    image_base_size: int
    ratio_index: int
    gen_h: int
    gen_w: int
    gen_timestep: int
    gen_start: int
    guidance_pos: int | None = None
    timestep_r_pos: int | None = None
    cond: tuple[CondSection, ...] = ()
    prompt_slice: tuple[int, int] = (0, 0)
    #: where the CoT segment (think / recaption text) sits; ``(p, p)`` when there is none: ``p`` is where the
    #: text stage starts writing (after ``"Assistant: "`` in the instruct template)
    cot_slice: tuple[int, int] = (0, 0)

    def __attrs_post_init__(self) -> None:
        lengths = {len(r) for r in self.tokens}
        if len(lengths) != 1:
            raise ValueError(f"CFG rows must be equally long, got lengths {sorted(lengths)}")

    # ------------------------------------------------------------------ sizes
    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def seq_len(self) -> int:
        return len(self.tokens[0])

    @property
    def num_image_tokens(self) -> int:
        return self.gen_h * self.gen_w

    @property
    def gen_end(self) -> int:
        return self.gen_start + self.num_image_tokens

    @property
    def prefix_len(self) -> int:
        """Positions before the generated image's ``<timestep>``: identical at every denoise step."""
        return self.gen_timestep

    @property
    def target_len(self) -> int:
        return self.gen_end - self.gen_timestep

    # ------------------------------------------------------------------ spans and positions
    @property
    def gen_image_slices(self) -> tuple[tuple[int, int], ...]:
        return ((self.gen_start, self.gen_end),)

    @property
    def joint_image_slices(self) -> tuple[tuple[int, int], ...]:
        return tuple(c.joint_span for c in self.cond)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """Bidirectional attention spans: every joint condition image and the generated image's ``<img>`` run."""
        return self.joint_image_slices + self.gen_image_slices

    @property
    def all_image_slices(self) -> tuple[tuple[int, int], ...]:
        out = []
        for c in self.cond:
            out += [(c.vae_start, c.vae_end), (c.vit_start, c.vit_end)]
        return tuple(out) + self.gen_image_slices

    def rope_images(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for c in self.cond:
            out += [(c.vae_start, c.vae_h, c.vae_w), (c.vit_start, c.vit_h, c.vit_w)]
        return tuple(out) + ((self.gen_start, self.gen_h, self.gen_w),)

    def positions(self) -> torch.Tensor:
        return positions_2d(self.seq_len, self.rope_images())

    # ------------------------------------------------------------------ tensor views (reference names)
    def token_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long, device=device)

    def _mask(self, slices: tuple[tuple[int, int], ...]) -> torch.Tensor:
        mask = torch.zeros(self.rows, self.seq_len, dtype=torch.bool)
        for s, e in slices:
            mask[:, s:e] = True
        return mask

    @property
    def gen_image_mask(self) -> torch.Tensor:
        return self._mask(self.gen_image_slices)

    @property
    def cond_vae_image_mask(self) -> torch.Tensor:
        return self._mask(tuple((c.vae_start, c.vae_end) for c in self.cond))

    @property
    def cond_vit_image_mask(self) -> torch.Tensor:
        return self._mask(tuple((c.vit_start, c.vit_end) for c in self.cond))

    @property
    def gen_timestep_scatter_index(self) -> torch.Tensor:
        return torch.full((self.rows, 1), self.gen_timestep, dtype=torch.long)

    @property
    def cond_timestep_scatter_index(self) -> torch.Tensor:
        return torch.tensor([[c.timestep for c in self.cond]] * self.rows, dtype=torch.long)

    @property
    def real_pos(self) -> torch.Tensor:
        return torch.full((self.rows, 1), self.seq_len, dtype=torch.long)


# ---------------------------------------------------------------------------------------------- KV requests


@attrs.frozen
class DiffusionKVRequest:
    """Scheduler-owned KV state of one execution sequence (one CFG row), laid out ``[prefix | target]``: the
    prefix is reusable, the target is rewritten every step, ``seq_len`` bounds the first-step allocation."""

    request_id: str
    sequence_id: int
    prefix_len: int
    target_len: int
    seq_len: int
    block_hashes: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)

    def __attrs_post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        if self.sequence_id < 0:
            raise ValueError("sequence_id must be non-negative")
        if self.prefix_len < 0:
            raise ValueError("prefix_len must be non-negative")
        if self.target_len <= 0 or self.seq_len <= 0:
            raise ValueError("target_len and seq_len must be positive")
        if self.prefix_len + self.target_len > self.seq_len:
            raise ValueError(f"prefix_len + target_len ({self.prefix_len} + {self.target_len}) must not exceed "
                             f"seq_len {self.seq_len}")

    @property
    def id(self) -> str:
        return f"{self.request_id}/diffusion-kv/{self.sequence_id}"


def kv_requests(request_id: str, layout: SequenceLayout, cfg_factor: int,
                block_hashes: tuple[tuple[str, ...], ...] | None = None) -> tuple[DiffusionKVRequest, ...]:
    """One KV request per CFG row (the row count must equal ``cfg_factor``)."""
    if layout.rows != cfg_factor:
        raise ValueError(f"Hunyuan tokenizer sequence count does not match CFG execution: rows={layout.rows}, "
                         f"cfg_factor={cfg_factor}")
    return tuple(DiffusionKVRequest(request_id, i, prefix_len=layout.prefix_len, target_len=layout.target_len,
                                    seq_len=layout.seq_len,
                                    block_hashes=block_hashes[i] if block_hashes is not None else ())
                 for i in range(layout.rows))


@attrs.frozen
class PreparedLayout:
    """What ``preprocess`` attaches at admission in ``paged_scheduler`` mode: the layout, the per-row KV
    requests and the prefix identity (hashed once across rows)."""

    layout: SequenceLayout
    kv_requests: tuple[DiffusionKVRequest, ...]
    identity: str
