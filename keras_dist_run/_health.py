"""What the launcher reads of its processes' health: heartbeats and failures.

Each process that joined the cluster rewrites `heartbeat_<rank>` in the
launcher's state folder four times a second (`keras_dist/cluster/_heartbeat.py`):
its training step, its progress (steps of `fit`, `evaluate`, `predict`) and
whether such a call runs. A process that ends on an uncaught exception
writes `failed_<rank>`. `Watch` turns them into the one line a user reads:
which process, where it stood, and why it is stopped.
"""

import dataclasses
import json
import os
import time

__all__ = [
    "HUNG",
    "RESTART_EXIT_CODE",
    "Failure",
    "Watch",
    "at_step",
    "failure_record",
    "silent_line",
]

# The launcher's exit status after a hang (as `timeout` exits).
HUNG = 124
RESTART_EXIT_CODE = 75
"""The exit status of a keras_dist process that failed because it lost a peer.

A process of a joined cluster whose collective or coordination call fails
because another process is gone or silent exits with 75 (EX_TEMPFAIL of
sysexits.h: try again); an uncaught error of its own exits with 1. A
scheduler can restart the group on 75 (and on the signals' 137 and 143)
and fail the job on 1; `keras-dist-run` blames the process that did not
exit 75. Guide: "Failures and restarts".

Example:

```python
import keras_dist as kd

assert kd.cluster.RESTART_EXIT_CODE == 75
```
"""


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why an attempt ended: the process blamed and the line that says so.

    `signature` is set for an uncaught exception (its type, message and
    step): the same one twice in a row is not retried.
    """

    rank: int
    line: str
    code: int
    signature: tuple | None = None


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def failure_record(state: str, rank: int) -> dict | None:
    """What process `rank` wrote when an uncaught exception ended it."""
    return _read(os.path.join(state, f"failed_{rank}"))


def at_step(step: int | None) -> str:
    """ " at step 1,203", or nothing before the first training step."""
    return f" at step {step:,}" if step else ""


def silent_line(rank: int, host: str | None, step: int | None, seconds: float) -> str:
    """How a frozen process is named, by the launcher and, without it, by
    its peers (`keras_dist/cluster/_heartbeat.py`): "process 1 (node1)
    stopped answering at step 420 (no heartbeat for 61 s)"."""
    on = f" ({host})" if host else ""
    return (
        f"process {rank}{on} stopped answering{at_step(step)} "
        f"(no heartbeat for {seconds:.0f} s)"
    )


# A heartbeat older than this while every process stalls: that process is
# frozen (it beats four times a second), not merely waiting.
_STALE_S = 5.0


class Watch:
    """Reads the heartbeats of `n` processes; names one that is hung.

    `heartbeat_timeout`: a process whose heartbeat file has not changed for
    that long is frozen (stopped, or its host hung). `hang_timeout` (None:
    off): while a `fit`/`evaluate`/`predict` runs, no process making a step
    for that long is a hang; the process furthest behind is named.
    """

    def __init__(
        self, state: str, n: int, heartbeat_timeout: float, hang_timeout: float | None
    ):
        self.state, self.n = state, n
        self.heartbeat_timeout, self.hang_timeout = heartbeat_timeout, hang_timeout
        self._progress: tuple | None = None
        self._progress_since = time.monotonic()
        self._next_read = 0.0

    def beats(self) -> dict[int, tuple[float, dict]]:
        """Each process's heartbeat: (seconds since it was written, payload)."""
        now = time.time()
        found = {}
        for rank in range(self.n):
            path = os.path.join(self.state, f"heartbeat_{rank}")
            try:
                age = now - os.stat(path).st_mtime
            except OSError:
                continue
            payload = _read(path)
            if payload is not None:
                found[rank] = (age, payload)
        return found

    def step(self, rank: int) -> int | None:
        """Where process `rank` stood (None: it sent no heartbeat)."""
        return _where(self.beats(), rank)

    def hung(self, running: list[int]) -> Failure | None:
        """The first running process found frozen or stuck, or None (read
        at most twice a second)."""
        now = time.monotonic()
        if now < self._next_read:
            return None
        self._next_read = now + 0.5
        beats = self.beats()
        for rank in running:
            if rank in beats and beats[rank][0] > self.heartbeat_timeout:
                return self._silent(beats, rank)
        if self.hang_timeout is None or not running:
            return None
        if any(rank not in beats for rank in running):
            return None  # Not every process is training yet.
        progress = tuple(beats[rank][1].get("progress", 0) for rank in running)
        in_call = any(beats[rank][1].get("in_call") for rank in running)
        if progress != self._progress or not in_call or max(progress) == 0:
            self._progress, self._progress_since = progress, now
            return None
        stalled = now - self._progress_since
        if stalled <= self.hang_timeout:
            return None
        # A process whose heartbeat is silent too is frozen: it, not the hang.
        stale = [rank for rank in running if beats[rank][0] > _STALE_S]
        if stale:
            return self._silent(beats, max(stale, key=lambda rank: beats[rank][0]))
        behind = min(progress)
        laggards = [r for r, p in zip(running, progress, strict=True) if p == behind]
        rank = laggards[0]
        where = at_step(beats[rank][1].get("step"))
        if len(laggards) == len(running):
            line = f"no process made progress for {stalled:.0f} s{where} (a hang)"
        else:
            line = (
                f"process {rank} made no progress for {stalled:.0f} s{where}, "
                "behind the others, which wait for it (a hang)"
            )
        return Failure(rank, line, HUNG)

    @staticmethod
    def _silent(beats: dict, rank: int) -> Failure:
        age, payload = beats[rank]
        line = silent_line(rank, payload.get("host"), _where(beats, rank), age)
        return Failure(rank, line, HUNG)


def _where(beats: dict, rank: int) -> int | None:
    """Process `rank`'s step: its last heartbeat's, or the step the others
    are at, if later (they wait in the step it did not finish; its own last
    heartbeat may be a moment older than its end)."""
    if rank not in beats:
        return None
    others = [beat[1].get("step") or 0 for r, beat in beats.items() if r != rank]
    return max(beats[rank][1].get("step") or 0, min(others, default=0))
