"""Helpers for writing tiny random-weight checkpoints (the ``tiny:*`` presets).

``init_visible_weights`` gives every parameter of a module seeded, non-trivial values, so that a zero-initialised
gate or projection cannot hide a bug: matrices and kernels ~ N(0, gain² / fan_in), norm weights ~ 1 + N(0, 0.1²),
everything else ~ N(0, 0.1²). Parameters are visited in sorted name order, so the same seed always gives the
same weights. A plugin whose model needs a different fan-in or norm test passes its own predicate.

``byte_level_tokenizer`` writes a byte-level BPE with no merges (any text encodes, one token per byte) plus the
given special tokens as a ``PreTrainedTokenizerFast`` directory. It needs ``tokenizers`` and ``transformers``,
which the core does not depend on: a plugin that calls it lists both in its own dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

#: ``(parameter name, parameter) -> value``; used for the fan-in and the norm-weight test.
FanIn = Callable[[str, "torch.Tensor"], int]
ParamTest = Callable[[str, "torch.Tensor"], bool]


def leading_fan_in(name: str, param: torch.Tensor) -> int:
    """Elements per output row: ``in_features`` for a linear weight, ``in_channels * kernel`` for a conv."""
    return max(1, math.prod(param.shape[1:]))


def named_norm_weight(name: str, param: torch.Tensor) -> bool:
    """A 1-D ``weight`` whose name mentions ``norm`` (``blocks.0.norm1.weight``, ``norm_q.weight``)."""
    return param.dim() == 1 and name.rsplit(".", 1)[-1] == "weight" and "norm" in name


def init_visible_weights(module: torch.nn.Module, seed: int, *, gain: float = 1.0,
                         fan_in: FanIn = leading_fan_in, is_norm_weight: ParamTest = named_norm_weight,
                         is_plain: ParamTest | None = None) -> None:
    """Overwrite every parameter of ``module`` in place with seeded noise (see the module docstring).

    ``fan_in(name, param)`` scales matrices (parameters with 2+ dims); ``is_norm_weight(name, param)`` picks the
    1-D parameters centred on 1; ``is_plain(name, param)``, when given, sends a parameter (say a 2-D modulation
    table) to the plain 0.1-noise rule whatever its shape. The global torch RNG is left untouched.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if is_plain is not None and is_plain(name, param):
                value = 0.1 * noise
            elif param.dim() >= 2:
                value = gain * noise / math.sqrt(fan_in(name, param))
            elif param.dim() == 1 and is_norm_weight(name, param):
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            param.copy_(value.to(param.dtype))


@attrs.frozen
class ByteLevelTokenizer:
    """What ``byte_level_tokenizer`` wrote: the directory, the vocabulary size and each special token's id."""

    path: Path
    vocab_size: int
    special_ids: Mapping[str, int]


def byte_level_tokenizer(target_dir: str | Path, special_tokens: Sequence[str], *, eos_token: str,
                         pad_token: str, bos_token: str | None = None,
                         model_max_length: int = 131072) -> ByteLevelTokenizer:
    """Write a merge-free byte-level BPE tokenizer holding ``special_tokens`` to ``target_dir``.

    The 256 byte symbols take ids 0..255 in sorted order and the special tokens follow in the given order.
    ``eos_token``/``pad_token``/``bos_token`` must be among ``special_tokens``. Needs ``tokenizers`` and
    ``transformers`` (imported here, not by the core).
    """
    named = {"eos_token": eos_token, "pad_token": pad_token, "bos_token": bos_token}
    for field, token in named.items():
        if token is not None and token not in special_tokens:
            raise ValueError(f"{field} {token!r} is not one of the special tokens")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    extra = {"bos_token": bos_token} if bos_token is not None else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token,
                                   model_max_length=model_max_length, **extra)
    path = Path(target_dir)
    fast.save_pretrained(str(path))
    ids: dict[str, int] = {}
    for token in special_tokens:
        found = tok.token_to_id(token)
        if found is None:  # pragma: no cover - add_special_tokens always adds them
            raise RuntimeError(f"special token {token!r} was not added to the byte-level tokenizer")
        ids[token] = int(found)
    return ByteLevelTokenizer(path=path, vocab_size=tok.get_vocab_size(), special_ids=ids)
