"""`PreemptionNotice`: SIGTERM noticed by every process at one agreed step."""

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

__all__ = ["PreemptionNotice"]

# What `signal.signal` returns and takes.
_SignalHandler = Callable[[int, FrameType | None], Any] | int | None


class PreemptionNotice:
    """Whether the job is preempted, asked at each step boundary.

    One process: SIGTERM is caught here (`install`, on the main thread) and
    `reached` is True from the next boundary. Several: JAX's preemption
    service owns SIGTERM; when any process gets it, all agree on one future
    step, and `reached(number)` (every process passing the same growing
    numbers) is True there on each. `notify()` is a notice from elsewhere
    (a watcher function): with several processes a SIGTERM to this one,
    which the service tells the others.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._previous: _SignalHandler = None

    def install(self) -> None:
        if jax.process_count() > 1:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        self._event.clear()
        self._previous = signal.signal(
            signal.SIGTERM, lambda signum, frame: self._event.set()
        )

    def uninstall(self) -> None:
        """Gives SIGTERM back to its previous handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def notify(self) -> None:
        if jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX tells the others.
        else:
            self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def reached(self, number: int) -> bool:
        if jax.process_count() == 1:
            return self._event.is_set()
        return multihost_utils.reached_preemption_sync_point(number)
