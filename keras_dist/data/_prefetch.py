"""Background prefetch: keep the next batches on the devices before the step."""

import queue
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Prefetcher"]

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Runs `iterator` on a daemon thread, `buffer_size` items ahead.

    Items are produced (read from the host pipeline, padded, copied to the
    devices) while the consumer's step runs. An exception in the producer is
    raised in the consumer at the item where it happened. `close()` (also on
    garbage collection) stops the thread within 0.1 s; nothing waits forever
    on a stopped consumer.

    Args:
        iterator: the items to produce.
        buffer_size: how many finished items may wait (>= 1).
        lazy: start producing at the first `next()` (not at construction),
            for iterators whose first step must follow the consumer's set-up.
    """

    def __init__(self, iterator: Iterator[Any], buffer_size: int, lazy: bool = False):
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._produce,
            args=(iterator,),
            daemon=True,
            name="keras_dist-prefetch",
        )
        if not lazy:
            self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, iterator: Iterator[Any]) -> None:
        try:
            for item in iterator:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as error:  # Re-raised in the consumer.
            self._put(_Failure(error))

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()

    def __del__(self):
        self.close()
