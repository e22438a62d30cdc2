"""RainFusion block-sparse attention plans (docs/contracts-status.md C4): pure host logic, testable on a CPU.

A model publishes the latent grid ``(t, h, w)`` of its video tokens through ``AttentionMetadata.latent_grid``; the
plan covers the real rows ``[prefix | video]`` of one document:

* ``prefix_len``: every non-video row (text, conditions, audio) — always dense, visible to every query and key;
* ``video_rows = t * h * w`` (``h, w`` are token-grid sides: pixel side / 32), ``used_len = prefix_len +
  video_rows``; rows past ``used_len`` (padding) are never handed to the kernel (it ignores masks, so padded keys
  would pollute the softmax);
* ``latent_shape = (t, h, w)``; blocks of **128 rows**.

**Any grid yields a plan.** MindIE-SD rearranges the video spatially into 8x8 tiles and promotes an irregular tail
into the always-kept prefix before building the block mask; :class:`RainFusionPlan` models that split so the
realised sparsity can be logged: the latent columns/rows beyond whole 8-wide tiles of every frame after the first
form a suffix, and the residue of the rest modulo 128 is promoted with it (1344x768, grid ``(62, 24, 42)``: 62496
video rows, 32 left over modulo 128, a 2928-row suffix, 2976 rows promoted, 59520 = 465 x 128 sparse rows).

A model whose documents lead with the video (LingBot: ``[video ; text]``) plans with ``video_first=True``: the plan
then says the video rows are the document's first ``video_rows`` and the backend hands the kernel the rotation
``[rest | video]`` (attention over a document is equivariant to reordering its rows, so rotating, attending and
rotating back is exact).

**Models attach plans themselves, per layer** — the model knows its layout and its layer index, the backend does
not. The backend function carries :func:`sparse_planner` as its ``sparse_planner`` attribute: a model that finds
it on the attention backend it was given builds a :class:`RainFusion` from its deployment options (sparsity,
exempt layers) and attaches :meth:`RainFusion.layer_metadata` to its calls. Under Ulysses sequence parallelism the
plan needs no change: every rank attends over the whole sequence for ``H / P`` heads with the full sequence's
metadata, so the plan (rows, blocks, prefix) is the single-process one and the kernel sees ``H / P`` heads
(:func:`ulysses_plan`); ring attention (keys split over ranks) cannot run a plan that ranks keys over the whole
sequence and is refused.

Dense attention still runs for warm-up steps (``step < start_step``), exempt layers (``skip_layers``), calls whose
metadata publishes no grid, and videos too short for block selection (fewer than :data:`MIN_VIDEO_BLOCKS` sparse
blocks): :meth:`RainFusion.plan` returns ``None`` there and the backend takes its dense path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
from omnicore.plugin import ConfigError

#: rows per block of the rf_v2 kernel (the only size it supports)
BLOCK_ROWS = 128
#: side of the spatial tiles MindIE-SD rearranges the video into (latent h/w multiples of 8 are best)
TILE = 8
#: fewest sparse blocks worth a block selection; shorter videos stay dense (our threshold)
MIN_VIDEO_BLOCKS = 2
DEFAULT_SPARSITY = 0.8
logger = logging.getLogger("omni_backends_npu")


def parse_layer_selector(value: str | Iterable[int] | None, field: str = "rainfusion.skip_layers") -> frozenset[int]:
    """``"0-3,38"`` -> ``{0, 1, 2, 3, 38}``; ``None``/``""`` -> empty; ints pass through. ``ConfigError`` naming
    ``field`` for anything else (negative, reversed ranges, empty items, words)."""
    if value is None:
        return frozenset()
    if not isinstance(value, str):
        items = list(value)
        if any(type(i) is not int or i < 0 for i in items):
            raise ConfigError(field, f"layer indices must be non-negative ints, got {items!r}")
        return frozenset(items)
    text = value.strip()
    if not text:
        return frozenset()
    layers: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            start = int(lo) if lo.strip().isdigit() else None
            end = (int(hi) if hi.strip().isdigit() else None) if dash else start
        except ValueError:
            start = end = None
        if start is None or end is None or end < start:
            raise ConfigError(field, f"expected a layer selector like '0-3,38' (non-negative ints and ascending "
                                     f"ranges), got {value!r} (bad item {part.strip()!r})")
        layers.update(range(start, end + 1))
    return frozenset(layers)


def _check_sparsity(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError("rainfusion.sparsity", f"must be a number in [0, 1], got {value!r}")


def _check_start_step(instance: Any, attribute: Any, value: Any) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError("rainfusion.start_step", f"must be an int >= 0, got {value!r}")


@attrs.frozen
class RainFusionConfig:
    """The typed block-sparse spec: ``sparsity`` in [0, 1] (share of key blocks each query block drops),
    ``start_step`` (dense warm-up steps), ``skip_layers`` (exempt layers, a selector like ``"0-3,38"``)."""

    sparsity: float = attrs.field(default=DEFAULT_SPARSITY, validator=_check_sparsity)
    start_step: int = attrs.field(default=0, validator=_check_start_step)
    skip_layers: frozenset[int] = attrs.field(default=frozenset(), converter=parse_layer_selector)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RainFusionConfig:
        unknown = sorted(set(values) - {"sparsity", "start_step", "skip_layers"})
        if unknown:
            raise ConfigError(f"rainfusion.{unknown[0]}", "unknown key (known: sparsity, start_step, skip_layers)")
        return cls(**dict(values))


def _check_grid(grid: Any) -> tuple[int, int, int]:
    if grid is None or len(grid) != 3 or any(type(n) is not int or n <= 0 for n in grid):
        raise ValueError(f"latent grid must be three positive ints (t, h, w), got {grid!r}")
    return int(grid[0]), int(grid[1]), int(grid[2])


@attrs.frozen
class RainFusionPlan:
    """What the rf_v2 kernel is told (``prefix_len``, ``used_len``, ``latent_shape``, ``sparsity``) plus the
    modelled split of the video rows into sparse blocks and always-kept promoted rows."""

    prefix_len: int
    latent_shape: tuple[int, int, int] = attrs.field(converter=_check_grid)
    sparsity: float = attrs.field(default=DEFAULT_SPARSITY, validator=_check_sparsity)
    block_size: int = BLOCK_ROWS
    #: the document is ``[video | rest]`` (the backend rotates it to the kernel's ``[prefix | video]``)
    video_first: bool = False

    def __attrs_post_init__(self) -> None:
        if type(self.prefix_len) is not int or self.prefix_len < 0:
            raise ValueError(f"prefix_len must be an int >= 0, got {self.prefix_len!r}")

    @property
    def video_rows(self) -> int:
        t, h, w = self.latent_shape
        return t * h * w

    @property
    def used_len(self) -> int:
        return self.prefix_len + self.video_rows

    @property
    def residue(self) -> int:
        """Video rows left over modulo the block size."""
        return self.video_rows % self.block_size

    @property
    def suffix_rows(self) -> int:
        """Rows beyond whole 8x8 tiles in every frame after the first (moved to the end by the rearrangement)."""
        t, h, w = self.latent_shape
        return (t - 1) * (h * w - (h // TILE * TILE) * (w // TILE * TILE))

    @property
    def promoted_rows(self) -> int:
        """The suffix plus the residue of the rest modulo 128: kept dense like the prefix."""
        rest = self.video_rows - self.suffix_rows
        return self.suffix_rows + rest % self.block_size

    @property
    def sparse_rows(self) -> int:
        return self.video_rows - self.promoted_rows

    @property
    def sparse_blocks(self) -> int:
        return self.sparse_rows // self.block_size

    @property
    def realised_sparsity(self) -> float:
        """The share of video keys actually dropped (promoted rows stay visible)."""
        return self.sparsity * self.sparse_rows / self.video_rows

    @property
    def selects_blocks(self) -> bool:
        """Whether the video is long enough for block selection (else the backend stays dense)."""
        return self.sparse_blocks >= MIN_VIDEO_BLOCKS

    def describe(self) -> str:
        return (f"RainFusion rf_v2: sparsity {self.sparsity:g} (realised {self.realised_sparsity:.3f}), grid "
                f"{list(self.latent_shape)}, prefix {self.prefix_len} rows, video {self.video_rows} rows "
                f"({self.sparse_blocks} sparse blocks of {self.block_size}, {self.promoted_rows} promoted)")


def build_plan(prefix_len: int, latent_grid: Any, *, sparsity: float = DEFAULT_SPARSITY,
               video_first: bool = False) -> RainFusionPlan:
    """The plan for ``prefix_len`` dense rows and a ``latent_grid`` video (any grid), the video last unless
    ``video_first``."""
    return RainFusionPlan(prefix_len=prefix_len, latent_shape=latent_grid, sparsity=sparsity, video_first=video_first)


def ulysses_plan(plan: RainFusionPlan, *, ulysses: int = 1, ring: int = 1) -> RainFusionPlan:
    """The plan each rank runs under ``ulysses`` x ``ring`` sequence parallelism.

    Ulysses swaps row shards for head shards before attention, so every rank attends over every row (for ``H /
    ulysses`` heads) with the full sequence's metadata: the plan is the same on every rank and equal to the
    single-process one — the rows it covers never shrink to ``T / ulysses``. Ring attention splits the *keys*
    over ranks, and rf_v2 ranks key blocks over the whole sequence, so ``ring > 1`` is refused (ConfigError)."""
    if type(ulysses) is not int or ulysses < 1:
        raise ConfigError("parallel", f"ulysses must be an int >= 1, got {ulysses!r}")
    if ring != 1:
        raise ConfigError("parallel", f"RainFusion needs ring degree 1 (it ranks keys over the whole sequence), "
                                      f"got ring={ring!r}; scale with ulysses instead")
    return plan


def real_rows(metadata: Any) -> int | None:
    """Rows of the one real document of a packed call (``[real]`` or ``[real | pad]``), else ``None``."""
    cu, cu_k = metadata.cu_seqlens_q, metadata.cu_k
    if cu != cu_k:
        return None
    valid = metadata.valid_kv_length
    if len(cu) == 2:
        return cu[1] if valid is None else valid
    if len(cu) == 3 and valid == cu[1]:
        return valid
    return None


@attrs.frozen
class RainFusion:
    """Decides, per step and layer, whether a call gets a plan (pure; the model attaches it to its metadata)."""

    config: RainFusionConfig = RainFusionConfig()

    def plan(self, metadata: Any, *, step: int | None, layer: int,
             video_first: bool = False) -> RainFusionPlan | None:
        """The plan for this call, or ``None`` = dense (warm-up, exempt layer, no grid, not one document, video
        too short, or rows that do not hold the grid). The metadata cannot say where a document's video rows sit:
        the model says it — last (``[prefix | video]``, the default) or first (``video_first``, LingBot's
        ``[video ; text]``), in ``(t, h, w)`` order either way. ``step=None``: the model does not count steps
        (no warm-up)."""
        if (step is not None and step < self.config.start_step) or layer in self.config.skip_layers:
            return None
        if metadata is None or metadata.latent_grid is None or metadata.causal:
            return None
        used = real_rows(metadata)
        if used is None:
            return None
        t, h, w = metadata.latent_grid
        prefix = used - t * h * w
        if prefix < 0:
            return None
        plan = build_plan(prefix, metadata.latent_grid, sparsity=self.config.sparsity, video_first=video_first)
        return plan if plan.selects_blocks else None

    def metadata_for(self, metadata: Any, *, step: int | None, layer: int, video_first: bool = False) -> Any:
        """``metadata`` with this call's plan attached (or without any plan: dense)."""
        plan = self.plan(metadata, step=step, layer=layer, video_first=video_first)
        if plan is None and getattr(metadata, "sparse_plan", None) is None:
            return metadata
        return attrs.evolve(metadata, sparse_plan=plan)

    def layer_metadata(self, metadata: Any, layers: int, *, step: int | None = None,
                       video_first: bool = False) -> tuple[Any, ...]:
        """One metadata record per layer ``0 .. layers-1`` (the plan attached, or not for exempt layers): what a
        model hands layer ``i``'s attention. The plan is computed once and shared."""
        planned = self.metadata_for(metadata, step=step, layer=-1, video_first=video_first)
        plain = metadata if getattr(metadata, "sparse_plan", None) is None else attrs.evolve(metadata,
                                                                                            sparse_plan=None)
        return tuple(plain if i in self.config.skip_layers else planned for i in range(layers))

    def describe(self) -> str:
        layers = ",".join(map(str, sorted(self.config.skip_layers))) or "none"
        return (f"RainFusion: sparsity {self.config.sparsity:g}, start step {self.config.start_step}, "
                f"exempt layers {layers}")


def sparse_planner(options: Mapping[str, Any] | None = None) -> RainFusion:
    """The planner a model builds from its deployment options (``sparsity``, ``start_step``, ``skip_layers``;
    ConfigError naming the option for bad values); attached to ``npu_rainfusion_attention`` as its
    ``sparse_planner`` attribute, which is how a model recognises a plan-executing backend."""
    planner = RainFusion(RainFusionConfig.from_mapping(dict(options or {})))
    logger.info(planner.describe())
    return planner


def keep_count(blocks: int, sparsity: float) -> int:
    """Key blocks each query block keeps: ``ceil(blocks * (1 - sparsity))``, at least one."""
    return max(1, math.ceil(blocks * (1.0 - sparsity) - 1e-9)) if blocks else 0
