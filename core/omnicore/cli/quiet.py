"""Keep third-party chatter out of the CLI: progress bars and warnings of diffusers, transformers, huggingface-hub
and tqdm ("Loading pipeline components...", "Loading weights", deprecation notes) unless ``--verbose``.

Applied before any plugin imports those libraries, through the switches they read at import time (environment
variables; a value the user already set wins) and Python's warning filters. omnicore's own messages go through
``logging`` (``--log-level``) and its own progress bar, which this leaves alone.
"""

from __future__ import annotations

import logging
import os
import warnings

#: What each library reads when it is imported (tqdm >= 4.66 takes any default from ``TQDM_<PARAM>``).
QUIET_ENVIRONMENT = {
    "TQDM_DISABLE": "1",  # every tqdm bar (diffusers' loading bars, transformers' "Loading weights")
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


#: Loggers that chatter at import time (torchao, which diffusers imports when it is installed).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def silence_third_party() -> dict[str, str]:
    """Set the quiet switches the user did not set themselves and ignore Python warnings; returns what it set."""
    applied = {k: v for k, v in QUIET_ENVIRONMENT.items() if k not in os.environ}
    os.environ.update(applied)
    warnings.simplefilter("ignore")
    for name in QUIET_LOGGERS:  # torchao's import notes (CUDA extensions absent on CPU builds, pytree notices)
        logging.getLogger(name).setLevel(logging.ERROR)
    return applied
