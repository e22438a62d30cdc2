"""Several models in one process under one memory budget: :class:`ModelPool` (see :mod:`omnicore.pool.pool` for
the policy), its entries (:class:`ModelEntry`, ``models.toml``) and the memory helpers."""

from ..sizes import format_bytes, parse_bytes
from .entries import ModelEntry, PoolFile, entries_from_args, load_models_file
from .memory import HostSwap, resident_bytes
from .pool import STATES, ModelCounters, ModelPool, ModelStatus

__all__ = ["STATES", "HostSwap", "ModelCounters", "ModelEntry", "ModelPool", "ModelStatus", "PoolFile",
           "entries_from_args", "format_bytes", "load_models_file", "parse_bytes", "resident_bytes"]
