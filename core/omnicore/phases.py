"""The one vocabulary of job phases, shared by the engine (:mod:`omnicore.engine.progress`) and the HTTP API
(:mod:`omnicore.server.progress`).

The engine reports :data:`ENGINE_PHASES`; the API reports :data:`API_PHASES`, which add the server's own steps
(``preparing`` before the engine runs the job, ``encode_output`` for writing the file, ``finalize``) and
:data:`API_PHASE_OF_ENGINE` says which API phase each running engine phase is. Every phase name is written
once, here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

QUEUED = "queued"
LOADING = "loading"  # waiting for its model to be brought onto the device (a model pool)
PREPARING = "preparing"
PREPROCESS = "preprocess"
ENCODE = "encode"
THINK = "think"  # a model writing text before it draws (step = tokens written, total_steps = the budget)
DENOISE = "denoise"
DECODE = "decode"
POSTPROCESS = "postprocess"
ENCODE_OUTPUT = "encode_output"
FINALIZE = "finalize"
DONE = "done"
FAILED = "failed"
CANCELLED = "cancelled"

#: What the engine's progress events carry, in order; the last three end a job.
ENGINE_PHASES: tuple[str, ...] = (QUEUED, LOADING, PREPROCESS, ENCODE, THINK, DENOISE, DECODE, POSTPROCESS,
                                  DONE, FAILED, CANCELLED)
TERMINAL_PHASES: frozenset[str] = frozenset({DONE, FAILED, CANCELLED})

#: What a job record's ``phase`` may be over HTTP, in order.
API_PHASES: tuple[str, ...] = (QUEUED, LOADING, PREPARING, PREPROCESS, ENCODE, THINK, DENOISE, DECODE, ENCODE_OUTPUT,
                               FINALIZE)

#: Running engine phase -> API phase. The engine's ``preprocess`` runs at submission (validation, before the job
#: is queued), so for the API the job is still ``queued`` then; the engine's ``postprocess`` is the API's
#: ``encode_output``.
API_PHASE_OF_ENGINE: Mapping[str, str] = MappingProxyType({
    QUEUED: QUEUED, LOADING: LOADING, PREPROCESS: QUEUED, ENCODE: ENCODE, THINK: THINK, DENOISE: DENOISE,
    DECODE: DECODE, POSTPROCESS: ENCODE_OUTPUT,
})
