"""Background prefetch: keep the next batches on the devices before the step."""

import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["Prefetcher"]

_END = object()
_JOIN_SECONDS = 5.0


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _produce(iterator: Iterator[Any], out: queue.Queue, stop: threading.Event):
    """The thread's work. It holds no reference to its `Prefetcher`, so a
    consumer that drops the prefetcher (a pass Keras abandons) stops it."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in iterator:
            if not put(item):
                return
        put(_END)
    except BaseException as error:  # Re-raised in the consumer.
        put(_Failure(error))
    finally:
        del iterator


def _stop(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread.ident is not None and thread is not threading.current_thread():
        thread.join(_JOIN_SECONDS)


class Prefetcher:
    """Runs `iterator` on a daemon thread, `buffer_size` items ahead.

    Items are produced (read from the host pipeline, padded, copied to the
    devices) while the consumer's step runs. An exception in the producer is
    raised in the consumer at the item where it happened.

    The thread has an owner: `close()` stops it (within 0.1 s when it waits
    on a full buffer) and joins it; so does dropping the last reference to
    the prefetcher, and so does the end of the Keras call it was made for
    (the input pipeline registers `close` with the call). Nothing waits
    forever on a stopped consumer.

    Args:
        iterator: the items to produce.
        buffer_size: how many finished items may wait (>= 1).
        lazy: start producing at the first `next()` (not at construction),
            for iterators whose first step must follow the consumer's set-up.
    """

    def __init__(self, iterator: Iterator[Any], buffer_size: int, lazy: bool = False):
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce,
            args=(iterator, self._queue, stop),
            daemon=True,
            name="keras_dist-prefetch",
        )
        self._done = False
        self._close = weakref.finalize(self, _stop, stop, self._thread)
        if not lazy:
            self._thread.start()

    @property
    def started(self) -> bool:
        """Whether the thread has started producing."""
        return self._thread.ident is not None

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if not self.started:
            self._thread.start()
        item = self._queue.get()
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, _Failure):
            self._finish()
            raise item.error
        return item

    def _finish(self) -> None:
        self._done = True
        self._close()

    def close(self) -> None:
        """Stops and joins the thread; later `next()` calls end the iteration."""
        self._done = True
        self._close()
