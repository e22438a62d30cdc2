"""Per-request and per-batch forward plans of the MiniMax-H3 DiT.

:class:`RequestPlan` holds what one request's forwards share at every step: the RoPE table, the token-refined
text rows, its row indices on the device and the timestep category of every row. :class:`BatchPlan` lays several
request plans end to end (each ``[real | pad]``: two documents per request, even when the pad is empty) so one
forward serves them all; per step, :meth:`BatchPlan.step_timesteps` turns per-request video/audio timesteps into
the shared table of distinct timesteps and the per-row index into it, on the host, without a device sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from omnicore.plugin import StepTimesteps, float32_bits

from .attention import Documents
from .layout import RequestLayout

#: Row timestep categories (docs/contracts-status.md C1.2).
CAT_VIDEO, CAT_COND_VIDEO, CAT_AUDIO, CAT_REF_AUDIO = 0, 1, 2, 3
_NCAT = 4


def row_categories(layout: RequestLayout) -> torch.Tensor:
    """``[seq_len]`` int64: every row's timestep category (text and pad rows follow the video timestep)."""
    cat = torch.zeros(layout.seq_len, dtype=torch.int64)
    nv, na = layout.num_condition_video_rows, layout.num_condition_audio_rows
    cat[layout.video_indices[:nv]] = CAT_COND_VIDEO
    cat[layout.audio_indices[na:]] = CAT_AUDIO
    cat[layout.audio_indices[:na]] = CAT_REF_AUDIO
    return cat


@attrs.frozen(eq=False)
class RequestPlan:
    layout: RequestLayout
    text: torch.Tensor  # [L, H] refined text rows (compute dtype, device)
    cos: torch.Tensor  # [seq_len, 1, R]
    sin: torch.Tensor
    tags: torch.Tensor  # [seq_len] int64 device; pad rows tagged 0
    device: torch.device

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.text, self.cos, self.sin, self.tags))


def _pad_tags(layout: RequestLayout) -> torch.Tensor:
    tags = torch.zeros(layout.seq_len, dtype=torch.int64)
    tags[: layout.used] = layout.token_tags
    return tags


@attrs.frozen(eq=False)
class BatchPlan:
    """Requests laid end to end; build with :meth:`pack` (or ``dit.pack``)."""

    requests: tuple[RequestPlan, ...]
    offsets: tuple[int, ...]  # start row of every request, then the total
    docs: Documents
    text: torch.Tensor  # [ΣL, H]
    text_index: torch.Tensor  # [ΣL] device rows
    video_index: torch.Tensor  # [ΣNv]
    audio_index: torch.Tensor  # [ΣNa]
    tags: torch.Tensor  # [T]
    cos: torch.Tensor  # [T, 1, R]
    sin: torch.Tensor
    pair_of_row: torch.Tensor  # [T] host int64: request * 4 + category
    pairs_used: torch.Tensor  # sorted host int64 pair ids present

    @classmethod
    def pack(cls, plans: Sequence[RequestPlan]) -> BatchPlan:
        if not plans:
            raise ValueError("a batch needs at least one request plan")
        devices = {p.device for p in plans}
        if len(devices) != 1:
            raise ValueError(f"request plans live on different devices: {sorted(map(str, devices))}")
        device = devices.pop()
        offsets, bounds, pairs = [0], [0], []
        vid, aud, txt = [], [], []
        max_doc = 0
        for i, p in enumerate(plans):
            lay, off = p.layout, offsets[-1]
            vid.append(lay.video_indices + off)
            aud.append(lay.audio_indices + off)
            txt.append(lay.text_indices + off)
            pairs.append(row_categories(lay) + i * _NCAT)
            bounds += [off + lay.used, off + lay.seq_len]
            max_doc = max(max_doc, lay.used, lay.pad_rows)
            offsets.append(off + lay.seq_len)
        single = len(plans) == 1
        grids = {p.layout.latent_grid for p in plans}  # published when every request shares one grid
        docs = Documents(bounds, device, valid_kv_length=plans[0].layout.used if single else None,
                         max_seqlen=max_doc, latent_grid=grids.pop() if len(grids) == 1 else None)
        pair_of_row = torch.cat(pairs)

        def cat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
            return ts[0] if single else torch.cat(list(ts))

        return cls(
            requests=tuple(plans), offsets=tuple(offsets), docs=docs,
            text=cat([p.text for p in plans]),
            text_index=cat(txt).to(device), video_index=cat(vid).to(device), audio_index=cat(aud).to(device),
            tags=cat([p.tags for p in plans]), cos=cat([p.cos for p in plans]), sin=cat([p.sin for p in plans]),
            pair_of_row=pair_of_row, pairs_used=torch.unique(pair_of_row, sorted=True),
        )

    # ------------------------------------------------------------------ sizes / splitting
    @property
    def total(self) -> int:
        return self.offsets[-1]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def video_rows(self) -> tuple[int, ...]:
        return tuple(p.layout.num_video_rows for p in self.requests)

    @property
    def audio_rows(self) -> tuple[int, ...]:
        return tuple(p.layout.num_audio_rows for p in self.requests)

    def split_video(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows.split(self.video_rows, dim=0))

    def split_audio(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows.split(self.audio_rows, dim=0))

    # ------------------------------------------------------------------ timesteps
    def row_timesteps(self, t_video: Sequence[float], t_audio: Sequence[float], condition_video: float = 0.999,
                      condition_audio: float = 1.0) -> torch.Tensor:
        """Per-row float32 timesteps ``[T]`` (CPU) — what :meth:`step_timesteps` reduces."""
        return self._pair_values(t_video, t_audio, condition_video, condition_audio)[self.pair_of_row]

    def _pair_values(self, t_video: Sequence[float], t_audio: Sequence[float], condition_video: float,
                     condition_audio: float) -> torch.Tensor:
        n = self.num_requests
        t_video = [float(t) for t in t_video]
        t_audio = [float(t) for t in t_audio]
        if len(t_video) != n or len(t_audio) != n:
            raise ValueError(f"need one video and one audio timestep per request ({n}), got "
                             f"{len(t_video)} and {len(t_audio)}")
        values = []
        for tv, ta in zip(t_video, t_audio):
            values += [tv, max(tv, float(condition_video)), ta, max(ta, float(condition_audio))]
        return torch.tensor(values, dtype=torch.float32)

    def step_timesteps(self, t_video: Sequence[float], t_audio: Sequence[float], condition_video: float = 0.999,
                       condition_audio: float = 1.0) -> StepTimesteps:
        """Distinct timesteps of one step (ascending, on the device), their host bits and the per-row index.

        ``t_video`` / ``t_audio``: one ``t = 1 - sigma`` per request, in pack order. Conditioning video rows take
        ``max(t_video, condition_video)``, reference audio rows ``max(t_audio, condition_audio)``; text and pad
        rows ``t_video``. Bit-identical to ``torch.unique(row_timesteps(...), sorted=True, return_inverse=True)``.
        """
        values = self._pair_values(t_video, t_audio, condition_video, condition_audio)
        used = self.pairs_used
        unique, inverse = torch.unique(values[used], sorted=True, return_inverse=True)
        pair_to_unique = torch.zeros(values.shape[0], dtype=torch.int64)
        pair_to_unique[used] = inverse
        device = self.docs.device
        return StepTimesteps(unique_timesteps=unique.to(device), timestep_bits=float32_bits(unique),
                             inverse_indices=pair_to_unique[self.pair_of_row].to(device))
