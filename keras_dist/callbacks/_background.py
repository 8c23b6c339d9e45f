"""One checkpoint write in flight; its failure raised on the training thread."""

import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable

from keras_dist.errors import CheckpointWriteError

__all__ = ["BackgroundWriter", "write_failed"]

# How much nicer than the training thread the writer threads run. Under
# load (devices computing a step on every core) a writer at the same
# priority takes a core from the step's device threads for the whole
# write, and a device waiting for the others stalls every one of them;
# at nice +10 the kernel gives the writer about a tenth of a contended
# core and every idle cycle, so the step keeps its cores and the write
# still ends long before the next save (benchmarks/README.md, "A
# lower-priority writer"). Linux only: elsewhere a thread id is no process
# id, and `setpriority(PRIO_PROCESS, ...)` would reach another process.
WRITER_NICENESS = 10


def _lower_priority() -> None:
    """Runs the calling thread `WRITER_NICENESS` nicer, where Linux lets it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        thread = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(
            os.PRIO_PROCESS, thread, max(now, min(now + WRITER_NICENESS, 19))
        )
    except OSError:  # A sandbox that forbids it: write at the same priority.
        pass


# The one thread of every Orbax save of keras_dist's callbacks in this
# process (`BackgroundWriter(orbax=True)`): with several processes each
# process must run Orbax's saves in the order the training thread submitted
# them, which is the same on every process. Two managers saving at once on
# two threads would enter Orbax's barriers ("CheckpointManager:save_start")
# together and in either order ("Barrier ... is already ongoing").
_orbax_executor: concurrent.futures.ThreadPoolExecutor | None = None
_orbax_lock = threading.Lock()


def _orbax_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _orbax_executor
    with _orbax_lock:
        if _orbax_executor is None:
            _orbax_executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="keras_dist-orbax", initializer=_lower_priority
            )
        return _orbax_executor


def write_failed(owner: str, path: str, error: BaseException, kept: str):
    """The `CheckpointWriteError` of a write that failed in the background."""
    return CheckpointWriteError(
        f"{owner}: writing {path} failed in the background "
        f"({type(error).__name__}: {str(error)[:1000]}). {kept}"
    )


class BackgroundWriter:
    """Runs one write at a time on a background thread.

    `submit` first waits for the write in flight (so writes finish in the
    order they were submitted: a newer never supersedes an older); an error
    of a write is raised as `CheckpointWriteError` (naming its path and
    cause) by the next `check`, `submit`, `wait` or `close`. With `orbax`,
    the writes run on the process's one Orbax thread, after the other
    callbacks' Orbax writes submitted before them; without, on this
    writer's own thread. Both threads run `WRITER_NICENESS` nicer than the
    training thread on Linux.
    """

    def __init__(self, owner: str, kept: str, *, orbax: bool = False):
        self.owner, self.kept, self.orbax = owner, kept, orbax
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._future: concurrent.futures.Future | None = None
        self._path = ""

    @property
    def pending(self) -> bool:
        return self._future is not None

    def submit(self, path: str, write: Callable[[], None]) -> None:
        self.wait()
        if self.orbax:
            executor = _orbax_thread()  # Shared: never shut down here.
        else:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1,
                    thread_name_prefix="keras_dist-checkpoint",
                    initializer=_lower_priority,
                )
            executor = self._executor
        self._path = path
        self._future = executor.submit(write)

    def check(self) -> None:
        """Raises the error of a finished write that failed; never waits."""
        if self._future is not None and self._future.done():
            self.wait()

    def wait(self) -> None:
        """Waits for the write in flight; raises `CheckpointWriteError` if it failed."""
        future, self._future = self._future, None
        if future is None:
            return
        error = future.exception()
        if error is not None:
            raise write_failed(self.owner, self._path, error, self.kept) from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
