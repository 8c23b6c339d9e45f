"""What a process tells `keras-dist-run` while it trains: alive, its step, its failure.

With the launcher (`KERAS_DIST_RUN_STATE` names its folder), a process that
joined the cluster starts a daemon thread that rewrites
`heartbeat_<process>` four times a second: `{"step": ..., "progress": ...,
"in_call": ...}` and goodput's ledger. `step` counts the training steps this
process ran (`fit`, from the step its optimizer restored), `progress` every
step of `fit`, `evaluate` and `predict`, `in_call` whether one of them is
running. The ledger: the step it resumed from (`restored`), when the thread
first and last saw a training step (`first_step_at`, `last_step_at`: the
time before the first is start-up and compilation), and the seconds since
the first the training thread waited for input, blocked in checkpoint saves
and spent in `evaluate`/`predict` (`seconds`, and as they stood at the last
step): the launcher's goodput report (`keras_dist_run/_goodput.py`).
The training loop only bumps counters (`PROGRESS`, from Keras's epoch
loop: `_seams/_trainer.py`); the thread writes. So the launcher tells a frozen
process (its file stops changing: SIGSTOP, a hung host), a cluster whose
loop makes no progress (every file changes, `progress` does not), and where
each stood. A process that ends on an uncaught exception writes
`failed_<process>` (`record_failure`: the exception and its step), which the
launcher compares across restarts: the same error at the same step twice is
not something a restart fixes. A process that exits writes its heartbeat
once more, so its last steps are counted however soon after them it ends.
Without the launcher: nothing.
"""

import atexit
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
    step's road): training steps, steps of any call, calls running; and
    seconds of the training thread: waiting for input outside `evaluate` and
    `predict` (`data/_call.py`), blocked in saves (`_checkpoint/pipeline.py`),
    in `evaluate`/`predict` calls (`in_call`)."""

    step: int = 0
    progress: int = 0
    calls: int = 0
    restored: int = 0
    evaluating: int = 0
    input_s: float = 0.0
    checkpoint_s: float = 0.0
    eval_s: float = 0.0


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
    writing = threading.Lock()  # The thread's beats and the last one, at exit.

    ledger = _Ledger()

    def beat() -> None:
        with writing:
            _write(path, ledger.snapshot(time.time()))

    def run() -> None:
        while not stop.is_set():
            beat()
            stop.wait(INTERVAL_SECONDS)

    def last_beat() -> None:
        stop.set()
        beat()

    thread = threading.Thread(target=run, name="keras_dist-heartbeat", daemon=True)
    _STARTED.update(process_id=process_id, stop=stop)
    thread.start()
    atexit.register(last_beat)


class _Ledger:
    """The heartbeat thread's view of the counters: when it first and last
    saw a training step, and the seconds counted since the first, in all and
    as they stood at the last (to a quarter second: it looks four times a
    second)."""

    KEYS = ("input", "checkpoint", "evaluation")

    def __init__(self) -> None:
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.last_step = 0
        self.base = (0.0, 0.0, 0.0)
        self.at_last = (0.0, 0.0, 0.0)

    def snapshot(self, now: float) -> dict:
        p = PROGRESS
        seconds = (p.input_s, p.checkpoint_s, p.eval_s)
        if p.step > p.restored and p.step != self.last_step:
            if self.first_at is None:
                self.first_at, self.base = now, seconds
            self.last_at, self.at_last = now, seconds
        self.last_step = p.step

        def since(values: tuple) -> dict:
            if self.first_at is None:
                return dict.fromkeys(self.KEYS, 0.0)
            pairs = zip(self.KEYS, values, self.base, strict=True)
            return {key: round(v - b, 3) for key, v, b in pairs}

        return {
            "step": p.step,
            "progress": p.progress,
            "in_call": p.calls > 0,
            "restored": p.restored,
            "first_step_at": self.first_at,
            "last_step_at": self.last_at,
            "seconds": since(seconds),
            "seconds_at_last_step": since(self.at_last),
        }


def set_step(step: int) -> None:
    """The training step this process resumes at (a `fit` restored from a backup)."""
    PROGRESS.step = PROGRESS.restored = int(step)


@contextlib.contextmanager
def in_call(method: str = "fit"):
    """A `fit`, `evaluate` or `predict` runs (its steps are progress; the
    time of `evaluate` and `predict`, fit's validation too, is not training)."""
    PROGRESS.calls += 1
    evaluating = method != "fit"
    started = time.perf_counter()
    PROGRESS.evaluating += evaluating
    try:
        yield
    finally:
        PROGRESS.calls -= 1
        PROGRESS.evaluating -= evaluating
        if evaluating and not PROGRESS.evaluating:
            PROGRESS.eval_s += time.perf_counter() - started


def record_failure(
    kind: type[BaseException],
    value: BaseException,
    tb: TracebackType | None,
    *,
    lost_a_peer: bool = False,
) -> None:
    """Writes `failed_<process>`: the uncaught exception, the step it ended
    at, and whether it was the loss of a peer (not this process's fault)."""
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
            "lost_a_peer": lost_a_peer,
        },
    )
