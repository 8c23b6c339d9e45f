"""The one input pipeline: read → check → pad → lay out → prefetch.

Every batch that reaches a keras_dist strategy goes through here: the passes
of `fit`/`evaluate`/`predict` (Keras's per-pass iterator seam), the single
batches of `*_on_batch`, and the iterators of `experimental_distribute_dataset`
and `distribute_datasets_from_function`. One pass (`InputPass`):

1. **read** host batches from the source (a Keras data adapter's iterator, a
   `tf.data` iterator, any iterable of batches);
2. **check** each against the pass's first batch (`BatchSignature`) and, with
   several processes, that every process reads the same data (or agree on
   each step's per-process rows, `ProcessBlocks`);
3. **pad** a batch that does not split over the replicas with zero rows to a
   multiple of them, keeping the count of real rows (`_partial_batch`);
4. **lay out** this process's rows over the mesh (the strategy's placement,
   `InputTarget.lay_out`): the last thing a batch's production does. A
   compiled `steps_per_execution=N` loop reads whole groups
   (`InputPass.next_group`): N full batches of one form are stacked on the
   host and laid out in one transfer (`InputTarget.lay_out_steps`), one
   program's input;
5. **prefetch** one step (or group) ahead on a background thread (`Prefetcher`) —
   only for sources that Keras (or the user) can restart: read-ahead never
   takes a batch from a one-shot generator that nobody could give back, nor
   reads a `PyDataset` that Keras keeps across epochs between its `on_epoch_end` and
   `on_epoch_begin`.

The real-row count travels with the batch in one of two carriers of the same
value: for Keras a `PaddedBatch` (static pytree data: the compiled step cuts
the padding before the model sees it, in every execution mode); for user
code the arrays themselves are marked, so `strategy.run`, `gather`, `reduce`
and `compute_average_loss` leave the padding out.
"""

import collections
import dataclasses
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from keras_dist.cluster import _sync
from keras_dist.data import _call
from keras_dist.data._batch_group import (
    BatchGroup,
    alike,
    columns_of,
    grouped,
    read_group,
)
from keras_dist.data._partial_batch import (
    as_padded_batch,
    batch_size_of,
    pad_rows,
    round_up,
)
from keras_dist.data._sparse import is_leaf, is_sparse
from keras_dist.data._target import InputTarget
from keras_dist.data.checks._batch_checks import BatchSignature
from keras_dist.data.host._multi_process import (
    ProcessBlocks,
    check_pass_end,
    check_pass_start,
    global_rows,
)

__all__ = ["InputPass", "Prefetcher", "Several", "element", "keras_batch"]


def _padded(strategy: InputTarget, data: Any) -> tuple[Any, int | None, Any]:
    """A global batch every process reads -> `(this process's rows, padded;
    the global batch size with several processes, else None; real rows or
    None)`."""
    if strategy.num_processes == 1:
        padded, num_real = pad_rows(data, strategy.num_local_replicas)
        return padded, None, num_real
    replicas = strategy.num_replicas_in_sync
    rows = strategy.process_rows(round_up(batch_size_of(data) or 0, replicas))
    return global_rows(data, replicas, rows)


def _laid_out(
    strategy: InputTarget, data: Any, rows: int | None, num_real, keras: bool
) -> Any:
    """Padded host rows laid out over the mesh: the last step of a batch.

    A Keras batch is wrapped (`PaddedBatch`) on the host first, so that the
    layout keeps the wrapper (a pytree node) and nothing of the input layer
    runs after it. User code's arrays carry their real rows themselves
    (`BatchRows`, set by the layout).
    """
    if keras:
        return strategy.lay_out(as_padded_batch(data, num_real), rows)
    return strategy.lay_out(data, rows, num_real=num_real)


def keras_batch(strategy: InputTarget, data: Any) -> Any:
    """One Keras batch `(x, y, sample_weight)` laid out: a `PaddedBatch` if padded."""
    return _laid_out(strategy, *_padded(strategy, data), keras=True)


def element(strategy: InputTarget, data: Any) -> Any:
    """One batch in its own structure, laid out; padded arrays are marked."""
    return _laid_out(strategy, *_padded(strategy, data), keras=False)


class _Reader:
    """The host side of a pass and its layout; iterated by the prefetch thread.

    Holds no reference to the `InputPass` that owns it, so dropping the pass
    stops its thread.
    """

    def __init__(
        self, strategy: InputTarget, batches, *, source, per_process, channel, call
    ):
        self.strategy = strategy
        self.source = source
        self.call = call
        self.sparse = False  # Whether the first batch holds a sparse matrix.
        # Batches an item holds: N while a `steps_per_execution=N` step
        # loop reads whole groups (`InputPass.next_group`), else 1. Read by
        # the producing thread at each item.
        self.group_size = 1
        self.host: Iterator[tuple] = self._checked(iter(batches), per_process, channel)

    def _checked(self, batches: Iterator[Any], per_process: bool, channel: str):
        """Yields `(host rows, global rows or None, real rows)` per step."""
        strategy, signature = self.strategy, BatchSignature(self.source)
        if strategy.num_processes > 1 and per_process:
            blocks = ProcessBlocks(strategy.num_local_replicas, self.source, channel)
            for index in range(1 << 62):
                data = next(batches, None)
                if data is not None:
                    signature.check(data, index)
                agreed = blocks(data)
                if agreed is None:
                    return
                block, rows, num_real = agreed
                yield block, rows * strategy.num_processes, num_real
        index = -1
        check = self.call.check_batch if self.call is not None else None
        for index, data in enumerate(batches):
            signature.check(data, index)
            if check is not None:
                check(data, index)
            if index == 0:
                if self.call is not None:
                    self.call.observe_batch_size(batch_size_of(data))
                if strategy.num_processes > 1:
                    check_pass_start(data, self.source, channel + "/start")
            yield data, None, None
        if strategy.num_processes > 1:
            check_pass_end(index + 1, self.source, channel + "/end")
        if index < 0 and self.call is not None and self.call.root.batch_size is None:
            raise ValueError(
                f"{self.source} has no batches: `{self.call.method}` needs at "
                "least one. Received: an empty input. Check that the dataset "
                "is not empty (e.g. a `filter`, `take(0)` or `skip` that drops "
                "everything, or a batch size larger than the data with "
                "`drop_remainder=True`)."
            )

    def peek_sparse(self) -> bool:
        """Reads the first host batch here (it stays first) and says whether
        it holds a sparse matrix (then every batch is read on the consumer's
        thread: `InputPass._next`)."""
        item = next(self.host, None)
        if item is not None:
            self.host = itertools.chain([item], self.host)
            self.sparse = _holds_sparse(item[0])
        return self.sparse

    def produced(self, keras: bool) -> Iterator[tuple[Any, float, bool, int]]:
        """Yields `(item, seconds producing it, first of the pass?, batches)`.

        An item is one batch laid out, or, while `group_size` is N > 1, the
        next N batches (`Several`): stacked on the host and laid out in one
        transfer where they can be (`_stacked`); else laid out one by one,
        as a `BatchGroup` still when they can run as one program (several
        processes: each lays out its rows of every batch). The
        consumer records the seconds (`InputStats`): on its own thread,
        after the item left this one.
        """
        first = True
        while True:
            start = time.perf_counter()
            count = self.group_size
            items = list(itertools.islice(self.host, count))
            if not items:
                return
            if first:
                self.sparse = _holds_sparse(items[0][0])
            if count == 1:
                item: Any = self._laid_out(items[0], keras)
            else:
                stacked = _stacked(self.strategy, items, count) if keras else None
                if stacked is None:  # Laid out one by one (stacked in the program).
                    batches = [self._laid_out(one, keras) for one in items]
                    item = Several(grouped(batches, count))
                else:
                    item = Several(stacked)
            yield item, time.perf_counter() - start, first, len(items)
            first = False

    def _laid_out(self, item: tuple, keras: bool) -> Any:
        data, rows, num_real = item
        if rows is None:
            data, rows, num_real = _padded(self.strategy, data)
        return _laid_out(self.strategy, data, rows, num_real, keras)


@dataclasses.dataclass(frozen=True)
class Several:
    """The batches of one `steps_per_execution` group: a `BatchGroup` stacked
    on the devices, or a list laid out one by one."""

    batches: BatchGroup | list


def _stacked(strategy: InputTarget, items: list, count: int) -> BatchGroup | None:
    """`count` host batches as one group laid out in one transfer, or None.

    They are when, on one process, they are `count` dense NumPy batches of
    one structure, shapes and dtypes, that split over the replicas unpadded:
    each leaf is stacked along a new leading axis and laid out at once
    (`lay_out_steps`), as a step would lay out each batch.
    """
    if len(items) < count or strategy.num_processes > 1:
        return None
    found = columns_of([data for data, _, _ in items])
    if found is None or not found[1]:
        return None
    treedef, columns = found
    replicas = strategy.num_local_replicas
    for column in columns:
        first = column[0]
        if (
            type(first) is not np.ndarray
            or not first.ndim
            or first.shape[0] % replicas
            or not alike(column, np.ndarray)
        ):
            return None
    stacked = strategy.lay_out_steps([np.stack(column) for column in columns])
    return BatchGroup(treedef, (False,) * len(columns), (), tuple(stacked))


def _holds_sparse(batch: Any) -> bool:
    """Whether `batch` holds a sparse matrix (a dense host batch: at once)."""
    leaves = jax.tree.leaves(batch)
    if all(type(leaf) is np.ndarray for leaf in leaves):
        return False
    return any(is_sparse(leaf) for leaf in jax.tree.leaves(batch, is_leaf=is_leaf))


class InputPass:
    """One pass over an input, as global batches laid out over a strategy.

    Args:
        strategy: where the batches go.
        batches: the host batches of this pass (global batches, or this
            process's rows with `per_process`).
        source: names the input in errors.
        per_process: each process brings its own rows (`AutoShardPolicy.FILE`
            / `OFF`, `distribute_datasets_from_function`).
        keras: yield Keras batches (`PaddedBatch` when padded) instead of the
            source's structure with marked arrays.
        prefetch: batches to prepare ahead on a background thread (0: none).
            Only for sources that can be read again from the start.
        channel: the cross-process exchange kind; the channel is named here,
            on the main thread, in the same order on every process.
    """

    def __init__(
        self,
        strategy: InputTarget,
        batches,
        *,
        source: str,
        per_process: bool = False,
        keras: bool = True,
        prefetch: int = 0,
        channel: str = "input",
    ):
        call = _call.active()
        named = _sync.channel(channel) if strategy.num_processes > 1 else ""
        self._reader = _Reader(
            strategy,
            batches,
            source=source,
            per_process=per_process,
            channel=named,
            call=call,
        )
        self._out = self._reader.produced(keras)
        self._stats = call.input_stats if call is not None else None
        self._prefetcher = None
        self._read_first = False
        self._keras = keras
        # Batches of a group read by `next()` (Keras's loop over the group).
        self._pending: collections.deque = collections.deque()
        if prefetch:
            # Lazy: a resume skips batches (on this thread) before the first step.
            self._prefetcher = Prefetcher(self._out, prefetch, lazy=True)
            if call is not None:
                call.on_close(_closer(self._prefetcher))

    def skip(self, count: int) -> int:
        """Reads `count` batches without laying them out; returns how many there were.

        Only before the first `next()`: a resumed `fit` replays its input so.
        """
        if self._read_first:
            raise RuntimeError("InputPass.skip() after the pass has started.")
        for done in range(count):
            if next(self._reader.host, None) is None:
                return done
        return count

    def __iter__(self) -> "InputPass":
        return self

    def __next__(self) -> Any:
        if self._pending:
            return self._pending.popleft()
        item = self._item()
        if not isinstance(item, Several):
            return item
        # Read as groups, taken batch by batch (Keras's loop over a group
        # that `FusedSteps` does not fuse).
        batches = item.batches
        if isinstance(batches, BatchGroup):
            batches = batches.batches(len(batches.varying[0]))
        self._pending.extend(batches[1:])
        return batches[0]

    def next_group(self, count: int) -> BatchGroup | list:
        """The next `count` batches, for one program (`steps_per_execution`).

        From the pass's first group on, the producing thread reads groups:
        `count` full batches of one form go to the devices stacked, in one
        transfer (a `BatchGroup`; with several processes, one transfer each,
        stacked in the program); fewer at the pass's end, or batches that
        differ (a padded partial batch), come as a list, each laid out. As
        Keras's loop: `StopIteration` when not even one batch is left.
        """
        if not self._read_first and self._keras:
            self._reader.group_size = count
        if self._pending or self._reader.group_size != count:
            return read_group(self, count)
        item = self._item()
        if isinstance(item, Several):
            return item.batches
        self._pending.append(item)  # Read before the groups began.
        return read_group(self, count)

    def read_singly(self) -> None:
        """Reads batch by batch from now on (a step loop that does not fuse)."""
        self._reader.group_size = 1

    def _item(self) -> Any:
        """The next item produced: a batch, or `Several`; its timings recorded."""
        start = time.perf_counter()
        item, seconds, first, batches = self._next()
        if self._stats is not None:
            self._stats.record(seconds, first=first, batches=batches)  # Producing.
            self._stats.record_wait(time.perf_counter() - start, batches)  # Waiting.
        return item

    def _next(self) -> Any:
        prefetcher = self._prefetcher
        if prefetcher is None:
            return next(self._out)
        if self._read_first:
            return next(prefetcher)
        self._read_first = True
        if self._reader.group_size > 1 and not self._reader.peek_sparse():
            return next(prefetcher)  # Groups are read on the thread from the first.
        # The first batch is read here. Sparse batches are read on this thread
        # only: Keras slices them with JAX ops (BCOO), and such eager JAX work
        # on a second thread while a step runs was seen to abort XLA on CPU.
        produced = next(self._out)
        if self._reader.sparse:
            prefetcher.close()
            self._prefetcher = None
        return produced

    def close(self) -> None:
        """Stops the prefetch thread, if any (also done when dropped)."""
        if self._prefetcher is not None:
            self._prefetcher.close()


def _closer(prefetcher: "Prefetcher"):
    """Closes `prefetcher` at the call's end unless it is gone already."""
    ref = weakref.ref(prefetcher)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    return close


# Background prefetch: the next batches on the devices before the step.

_END = object()
_JOIN_SECONDS = 5.0


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _produce(iterator: Iterator[Any], out: queue.Queue, stop: threading.Event):
    """The thread's work. It holds no reference to its `Prefetcher`, so a
    consumer that drops the prefetcher (a pass Keras abandons) stops it."""
    for item in _ended(iterator):
        while not stop.is_set():  # Put, unless stopped (checked every 0.1 s).
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        else:
            return


def _ended(iterator: Iterator[Any]) -> Iterator[Any]:
    """`iterator`'s items, then `_END`, or a `_Failure` where it raised."""
    try:
        yield from iterator
        yield _END
    except GeneratorExit:  # Closed: the consumer stopped.
        raise
    except BaseException as error:  # Re-raised in the consumer.
        yield _Failure(error)
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
        if self._thread.ident is None:
            self._thread.start()
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stops and joins the thread; later `next()` calls end the iteration."""
        self._done = True
        self._close()
