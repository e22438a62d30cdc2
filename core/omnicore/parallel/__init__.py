"""Multi-device serving on ``torch.distributed``: one engine over ``cfg x ulysses`` worker processes.

* :mod:`.config` — ``--parallel cfg=2,ulysses=2`` and the rank grid;
* :mod:`.context` — this rank's coordinates, process groups and traffic counter (``LoadOptions.parallel``);
* :mod:`.collectives` — all-to-all / all-gather with byte accounting;
* :mod:`.cfg` — CFG-parallel branches and the data-parallel fallback without guidance;
* :mod:`.ulysses` — sequence shards and the Ulysses attention wrapper;
* :mod:`.worker` / :mod:`.group` — worker processes replaying rank 0's batch plan, and rank 0's handle on them;
* :mod:`.lockstep` — what a rank failing inside a phase with collectives (encode, step, shared decode) does, so
  its peers fail within seconds instead of waiting in a collective until the group's timeout.
"""

from .config import ParallelConfig
from .context import ParallelContext

__all__ = ["ParallelConfig", "ParallelContext"]
