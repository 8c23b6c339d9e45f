"""What a process tells `keras-dist-run` while it trains: alive, its step, its failure.

With the launcher (`KERAS_DIST_RUN_STATE` names its folder), a process that
joined the cluster starts a daemon thread that rewrites
`heartbeat_<process>` four times a second: `{"step": ..., "progress": ...,
"in_call": ...}`. `step` counts the training steps this process ran
(`fit`, from the step its optimizer restored), `progress` every step of
`fit`, `evaluate` and `predict`, `in_call` whether one of them is running.
The training loop only bumps counters (`PROGRESS`, from Keras's epoch
loop: `_seams/_trainer.py`); the thread writes. So the launcher tells a frozen
process (its file stops changing: SIGSTOP, a hung host), a cluster whose
loop makes no progress (every file changes, `progress` does not), and where
each stood. A process that ends on an uncaught exception writes
`failed_<process>` (`record_failure`: the exception and its step), which the
launcher compares across restarts: the same error at the same step twice is
not something a restart fixes. Without the launcher: nothing.
"""

import contextlib
import dataclasses
import json
import os
import threading
import time
import traceback
from types import TracebackType

__all__ = ["PROGRESS", "in_call", "record_failure", "set_step", "start"]

INTERVAL_SECONDS = 0.25


@dataclasses.dataclass
class Progress:
    """The counters the training loop bumps (attributes: no call on the
    step's road): training steps, steps of any call, calls running."""

    step: int = 0
    progress: int = 0
    calls: int = 0


PROGRESS = Progress()
_STARTED: dict = {}


def _folder() -> str | None:
    return os.environ.get("KERAS_DIST_RUN_STATE") or None


def _write(path: str, payload: dict) -> None:
    """`payload` as JSON at `path`, whole or not at all (the launcher reads it)."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)


def start(process_id: int | None) -> None:
    """Starts this process's heartbeat thread (once; only under the launcher)."""
    folder = _folder()
    if folder is None or process_id is None or _STARTED:
        return
    path = os.path.join(folder, f"heartbeat_{process_id}")
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            _write(path, _snapshot())
            stop.wait(INTERVAL_SECONDS)

    thread = threading.Thread(target=run, name="keras_dist-heartbeat", daemon=True)
    _STARTED.update(process_id=process_id, stop=stop)
    thread.start()


def _snapshot() -> dict:
    return {
        "step": PROGRESS.step,
        "progress": PROGRESS.progress,
        "in_call": PROGRESS.calls > 0,
    }


def set_step(step: int) -> None:
    """The training step this process is at (a `fit` restored from a backup)."""
    PROGRESS.step = int(step)


@contextlib.contextmanager
def in_call():
    """A `fit`, `evaluate` or `predict` runs (its steps are progress)."""
    PROGRESS.calls += 1
    try:
        yield
    finally:
        PROGRESS.calls -= 1


def record_failure(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    """Writes `failed_<process>`: the uncaught exception and the step it ended at."""
    folder = _folder()
    if folder is None or "process_id" not in _STARTED:
        return
    frames = traceback.extract_tb(tb)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    _write(
        os.path.join(folder, f"failed_{_STARTED['process_id']}"),
        {
            "type": kind.__name__,
            "message": str(value)[:500],
            "where": where,
            "step": PROGRESS.step,
            "time": time.time(),
        },
    )
