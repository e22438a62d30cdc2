"""How the ranks of a worker group leave a phase with collectives together, or find out that they cannot.

Every denoise step, a shared VAE decode and, under tensor parallelism, the encode too (a TP text encoder, a DiT
token refiner run at encode time, a text stage on the TP ranks, rank 0's shared host encode) run collectives. A
rank that raises inside such a phase cannot tell whether its peers already wait in a collective it will never
enter; they would wait there until the process group's timeout (minutes).

* A **step** or a **shared decode** that fails ends the group at once: a worker reports where and why to rank 0
  and exits (its peers' pending collective then fails: a closed connection on gloo, rank 0 aborting its
  communicators on NCCL/HCCL), and rank 0 failing ends the workers (:class:`~.group.WorkerGroup`).
* The **encode** fails for the request's own reasons more often (a layout that does not fit, a reference the
  encoder rejects, rank 0's shared encode announcing its error to every rank), and such a failure strikes every
  rank at the same point. So after every encode the ranks exchange how it ended (one small gather on the control
  group, :func:`settle_on_worker` and ``WorkerGroup.encoding``): when every rank got there the batch fails with the
  first error, noted with its rank, and the group stays in step. A rank whose encode failed waits at most
  ``out_of_step_s`` (:data:`OUT_OF_STEP_S`) for that exchange; past it the ranks it waits for are taken to sit in a
  collective it skipped, and the group is ended (a worker exits, rank 0 ends the workers). Ranks in step reach the
  exchange within the skew of their last local work, milliseconds on an accelerator; a longer skew only ends a
  group that could have carried on, never makes one hang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: Seconds a rank whose encode failed waits for the others to end theirs before it takes the ranks to be out of
#: step (``RankSpec.out_of_step_s``).
OUT_OF_STEP_S = 10.0


def where(command: Sequence[Any]) -> str:
    """The phase a rank-0 command puts a worker in, as error messages name it."""
    kind = command[0]
    if kind == "batch":
        return "the encode"
    if kind == "step":
        return f"denoise step {command[1]}"
    if kind == "decode":
        return "the parallel VAE decode" if len(command) > 1 and command[1] else "the decode"
    if kind == "select":
        return "dropping cancelled requests"
    return f"the {kind!r} command"


def describe(exc: BaseException, limit: int = 1000) -> str:
    """``Type: message`` of ``exc`` on one bounded line (it travels to rank 0 and into health reports)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextmanager
def deadline(seconds: float | None, on_expiry: Callable[[], object]) -> Iterator[None]:
    """Call ``on_expiry`` (on a timer thread) if the block has not ended within ``seconds`` (None: never)."""
    timer = None
    if seconds is not None:
        timer = threading.Timer(seconds, on_expiry)
        timer.daemon = True
        timer.name = "omnicore-out-of-step"
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


def settle_on_worker(control: ProcessGroup, error: BaseException | None, out_of_step_s: float,
                     leave: Callable[[str], object]) -> None:
    """A worker's side of the exchange after an encode: send rank 0 ``error`` (None: encoded). With an error, wait
    at most ``out_of_step_s`` for the exchange and then ``leave`` (report and exit): a rank still missing waits
    in a collective this one skipped."""
    import torch.distributed as dist

    def out_of_step() -> None:
        assert error is not None
        leave(f"the encode ({describe(error)}); the other ranks had not ended theirs {out_of_step_s:g} s later, so "
              "the ranks are out of step")

    with deadline(out_of_step_s if error is not None else None, out_of_step):
        dist.gather_object(picklable(error), None, dst=0, group=control)


def picklable(error: BaseException | None) -> BaseException | None:
    """``error`` as it can cross the control group: itself when it survives pickling (a LoRAError names the
    adapter and the key), else its text."""
    import pickle

    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(describe(error))


def note_rank(error: BaseException, rank: int, world_size: int, where: str | None = None,
              others: Sequence[int] | None = None) -> None:
    """Add a note naming the rank ``error`` was raised on (and the other ranks that failed the same phase)."""
    add_note = getattr(error, "add_note", None)  # (Python 3.11+)
    if add_note is None:
        return
    text = f"(raised on rank {rank} of {world_size}"
    if where is not None:
        text += f" in {where}"
    if others is not None:
        text += f"; other ranks that failed: {', '.join(str(r) for r in others) or 'none'}"
    add_note(text + ")")


__all__ = ["OUT_OF_STEP_S", "deadline", "describe", "note_rank", "picklable", "settle_on_worker", "where"]
