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

Without the launcher (a scheduler started the processes: TF_CONFIG, SLURM),
the same beat goes through JAX's coordination service instead (its
key-value store: `keras_dist/beat/<process>`, once a second; `PeerWatch`),
and every process watches the next one (process `p` watches `p + 1`, the
last watches 0: each is watched once, and the store's traffic grows with
the processes, not their square). A peer silent for
`$KERAS_DIST_HEARTBEAT_TIMEOUT` seconds (default 60; 0: off) is named -
process, host, step, seconds silent: the launcher's line - and this process
exits 75 (`RESTART_EXIT_CODE`: restart the job), before JAX's coordination
service would abort a healthy process for it; a coordination service that
stops answering names process 0, its host. A peer that failed of its own
error (it says so in the store: `_sync.mark_exit`) ends this process with
status 1 after a grace of `_OWN_ERROR_GRACE_S` (its own traceback, if it is
raising the same error), so that every process of a job with a bug exits
1 and a scheduler's highest status says "do not retry".
"""

import atexit
import contextlib
import dataclasses
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from keras_dist.errors import ClusterConfigError
from keras_dist_run._health import RESTART_EXIT_CODE, silent_line

__all__ = [
    "PROGRESS",
    "PeerWatch",
    "in_call",
    "record_failure",
    "set_step",
    "start",
    "timeout_from_environment",
]

INTERVAL_SECONDS = 0.25
TIMEOUT_VARIABLE = "KERAS_DIST_HEARTBEAT_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
HOST = socket.gethostname()


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
    """Starts this process's heartbeat thread (once; only under the launcher:
    without it, `PeerWatch`)."""
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
            "host": HOST,
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


def timeout_from_environment() -> float:
    """`$KERAS_DIST_HEARTBEAT_TIMEOUT` in seconds (default 60; 0: off).

    Raises:
        ClusterConfigError: if it is not a number of seconds >= 0.
    """
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise ClusterConfigError(
            f"${TIMEOUT_VARIABLE} must be a number of seconds (0 turns the "
            f"peers' heartbeat off), e.g. 60. Received: {TIMEOUT_VARIABLE}="
            f"{text!r}."
        )
    return value


# How long a process whose peer failed of its own error lets its own
# exception hook speak first (the processes may be raising the same error).
_OWN_ERROR_GRACE_S = 3.0
_BEATS = "keras_dist/beat"
# How long a finishing process waits for its watch's store call in flight.
_CLOSE_WAIT_S = 5.0
_EXITED = "keras_dist/exited"


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class PeerWatch:
    """Without the launcher: this process's heartbeat in JAX's key-value
    store, and its watch of the next process (module docstring).

    Two daemon threads: one exchanges with the store once a second (its
    calls may block: a stopped process 0 holds the store), one judges twice
    a second from what the first last saw, so a store that stops answering
    is noticed too. `end` (default: flush and `os._exit`) is the test seam.
    """

    def __init__(
        self,
        client: Any,
        process: int,
        count: int,
        timeout: float,
        end: Callable[[int], None] = _exit,
    ) -> None:
        self.client, self.me, self.timeout, self.end = client, process, timeout, end
        self.peer = (process + 1) % count
        now = time.monotonic()
        self.answered = now  # The store's last answer.
        self.peer_beat: dict = {}
        self.peer_since = now  # When the peer's beat last changed.
        self.peer_ended = False
        self.failed: tuple[int, str, float] | None = None  # A peer's own error.
        self.stop = threading.Event()
        self.sequence = 0
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        self.threads = [
            threading.Thread(target=target, name=f"keras_dist-peer-{name}", daemon=True)
            for target, name in ((self._exchanges, "beat"), (self._judge, "watch"))
        ]
        for thread in self.threads:
            thread.start()
        # Registered after JAX's own clean-up (at its import), so run before
        # it: JAX then shuts its client down, and a thread still inside one
        # of the client's calls would come back into an interpreter being
        # finalized (Python ends such a thread with a forced unwind through
        # the call's C++ frames: "FATAL: exception not rethrown", SIGABRT,
        # 3 runs in 25 of two processes that had finished their programs).
        atexit.register(self.close)

    def close(self, within: float = _CLOSE_WAIT_S) -> None:
        """Stops both threads and waits (at most `within` s: a store call
        may block while process 0 is stopped) for their calls to end."""
        self.stop.set()
        deadline = time.monotonic() + within
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def exchange(self) -> None:
        """One round: this process's beat written, the peer's and every
        process's exit read."""
        self.sequence += 1
        beat = {"sequence": self.sequence, "host": HOST, "step": PROGRESS.step}
        self.client.key_value_set(
            f"{_BEATS}/{self.me}", json.dumps(beat), allow_overwrite=True
        )
        exits = dict(self.client.key_value_dir_get(f"{_EXITED}/"))
        try:
            peer = json.loads(self.client.key_value_try_get(f"{_BEATS}/{self.peer}"))
        except Exception:  # Not written yet: JAX raises its XlaRuntimeError.
            peer = self.peer_beat
        now = time.monotonic()
        self.answered = now
        if peer.get("sequence") != self.peer_beat.get("sequence"):
            self.peer_beat, self.peer_since = peer, now
        self.peer_ended = f"{_EXITED}/{self.peer}" in exits  # Not silent: gone.
        for key, how in exits.items():
            process = int(key.rsplit("/", 1)[-1])
            if how.startswith("failed") and self.failed is None and process != self.me:
                self.failed = (process, how, now)

    def verdict(self, now: float) -> tuple[int, str] | None:
        """(exit status, line) if this process must end, else None."""
        if self.failed is not None and now - self.failed[2] > _OWN_ERROR_GRACE_S:
            process, how, _ = self.failed
            return 1, (
                f"process {process} {how}; this process (process {self.me}) "
                "exits 1 too: a bug is not something a restart fixes"
            )
        silent_for = now - self.peer_since
        if silent_for > self.timeout and not self.peer_ended:
            rank, beat = self.peer, self.peer_beat
        elif now - self.answered > self.timeout and self.me != 0:
            # The store stopped answering: process 0, which hosts it.
            rank, beat, silent_for = 0, {}, now - self.answered
        else:
            return None
        # At the step this process waits in for it, if later than its last
        # beat's (the launcher's rule: `keras_dist_run/_health._where`).
        step = max(beat.get("step") or 0, PROGRESS.step)
        line = silent_line(rank, beat.get("host"), step, silent_for)
        return RESTART_EXIT_CODE, (
            f"{line}; this process (process {self.me}) exits "
            f"{RESTART_EXIT_CODE} (restart the job: it resumes from its last backup)"
        )

    def _exchanges(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(Exception):  # The judge sees the silence.
                self.exchange()
            self.stop.wait(1.0)

    def _judge(self) -> None:
        while not self.stop.wait(0.5):
            found = self.verdict(time.monotonic())
            if found is not None and not self.stop.is_set():
                status, line = found
                print(f"keras_dist: {line}.", file=sys.stderr, flush=True)
                how = "failed" if status == 1 else "lost a peer"
                self._mark(f"{how} ({line.split(';')[0]})" if status == 1 else how)
                self.end(status)
                return

    def _mark(self, how: str) -> None:
        """This process's exit in the store (`_sync.mark_exit`), for at most
        a second: the store may be the silent one."""
        key = f"{_EXITED}/{self.me}"

        def mark() -> None:
            with contextlib.suppress(Exception):
                self.client.key_value_set(key, how, allow_overwrite=True)

        thread = threading.Thread(target=mark, daemon=True)
        thread.start()
        thread.join(1.0)
