"""Distributed datasets: global batches, laid out over the replicas, prefetched.

`strategy.experimental_distribute_dataset(dataset)` takes a dataset batched by
the *global* batch size; `strategy.distribute_datasets_from_function(fn)`
calls `fn(input_context)` for a dataset batched by the *per-replica* batch size
and groups one batch per replica into a global batch. Either way, iterating
yields the dataset's element structure with every array a global `jax.Array`
split along the batch axis over the replicas. A partial batch is padded to a
multiple of the replicas and its arrays remember the real row count, so that
`strategy.run`, `compute_average_loss`, `gather` and `reduce` leave the
padding out.
"""

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from keras_dist.cluster import _sync
from keras_dist.data._auto_shard import is_per_process, per_process_share
from keras_dist.data._batch_checks import BatchSignature
from keras_dist.data._input_context import InputContext, InputOptions
from keras_dist.data._multi_process import (
    ProcessBlocks,
    check_pass_end,
    check_pass_start,
)
from keras_dist.data._prefetch import Prefetcher

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "distribute_dataset",
    "distribute_datasets_from_function",
]


def _is_tf_dataset(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("tensorflow") and hasattr(
        dataset, "element_spec"
    )


def _check_batched(dataset: Any, argument: str, hint: str) -> None:
    import tensorflow as tf

    unbatched = [
        spec
        for spec in tf.nest.flatten(dataset.element_spec)
        if getattr(spec, "shape", None) is not None and spec.shape.rank == 0
    ]
    if unbatched:
        raise ValueError(
            f"`{argument}` must be batched, but its elements have scalar "
            f"components ({unbatched[0]}). Received: element_spec="
            f"{dataset.element_spec}. {hint}"
        )


def _host_batches(dataset: Any) -> Callable[[], Iterator[Any]]:
    """A function that starts a new pass over `dataset`, yielding host batches."""
    if _is_tf_dataset(dataset):
        return dataset.as_numpy_iterator
    if isinstance(dataset, Iterator):
        return lambda: dataset  # One pass only: it is an iterator already.
    if isinstance(dataset, Iterable):
        return lambda: iter(dataset)
    raise TypeError(
        "The dataset must be a `tf.data.Dataset` or an iterable of batches. "
        f"Received: dataset of type {type(dataset).__name__}."
    )


class DistributedIterator:
    """An iterator over global, replica-split batches; `next()` or `get_next()`."""

    def __init__(
        self,
        strategy,
        host_iterator: Iterator[Any],
        options: InputOptions,
        source: str,
        per_process: bool = False,
    ):
        self._strategy = strategy
        self._source = source
        self._per_process = per_process
        self._signature = BatchSignature(source)
        # Named here, on the main thread: the exchanges may run on a prefetch
        # thread, and every process must number them alike.
        self._channel = _sync.channel("input") if strategy._spans_processes else ""
        batches = self._distributed(host_iterator)
        if options.experimental_fetch_to_device:
            batches = Prefetcher(batches, options.experimental_per_replica_buffer_size)
        self._batches = batches

    def _distributed(self, host_iterator: Iterator[Any]) -> Iterator[Any]:
        strategy = self._strategy
        if strategy._spans_processes and self._per_process:
            yield from self._per_process_blocks(host_iterator)
            return
        index = -1
        for index, batch in enumerate(host_iterator):
            self._signature.check(batch, index)
            if index == 0 and strategy._spans_processes:
                check_pass_start(batch, self._source, self._channel + "/start")
            yield strategy._distribute_element(batch)
        if strategy._spans_processes:
            check_pass_end(index + 1, self._source, self._channel + "/end")

    def _per_process_blocks(self, host_iterator: Iterator[Any]) -> Iterator[Any]:
        """Each process's own batches; every step agreed, so none waits forever."""
        blocks = ProcessBlocks(
            self._strategy._local_replicas(), self._source, self._channel
        )
        index = 0
        while True:
            batch = next(host_iterator, None)
            if batch is not None:
                self._signature.check(batch, index)
            agreed = blocks(batch)
            if agreed is None:
                return
            block, rows, num_real = agreed
            yield self._strategy._distribute_element(block, block=(rows, num_real))
            index += 1

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def get_next(self) -> Any:
        """The next global batch; raises `StopIteration` at the end."""
        return next(self)

    def close(self) -> None:
        """Stops the prefetch thread (also done when garbage collected)."""
        if isinstance(self._batches, Prefetcher):
            self._batches.close()


class DistributedDataset:
    """An iterable of global batches split over a strategy's replicas.

    Each `iter()` starts a new pass over the underlying dataset.
    """

    def __init__(
        self,
        strategy,
        start_pass: Callable[[], Iterator[Any]],
        *,
        options: InputOptions,
        source: str,
        per_process: bool = False,
    ):
        self._strategy = strategy
        self._start_pass = start_pass
        self._options = options
        self._source = source
        self._per_process = per_process

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(
            self._strategy,
            self._start_pass(),
            self._options,
            self._source,
            self._per_process,
        )

    def __repr__(self) -> str:
        return f"DistributedDataset({self._source}, strategy={self._strategy!r})"


def _options(options: InputOptions | None) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"`options` must be a `kd.InputOptions`. Received: options={options!r}."
        )
    return options


def distribute_dataset(strategy, dataset: Any, options=None) -> DistributedDataset:
    options = _options(options)
    if _is_tf_dataset(dataset):
        _check_batched(
            dataset,
            "dataset",
            "Batch it by the global batch size first: "
            "`dataset.batch(per_replica_batch * strategy.num_replicas_in_sync)`.",
        )
    source = type(dataset).__name__
    dataset = per_process_share(strategy, dataset)
    return DistributedDataset(
        strategy,
        _host_batches(dataset),
        options=options,
        source=source,
        per_process=is_per_process(dataset),
    )


def _grouped(batches: Iterator[Any], group: int) -> Iterator[Any]:
    """Concatenates `group` consecutive per-replica batches into one."""
    import jax

    pending: list = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == group:
            yield jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *pending)
            pending = []
    if pending:
        yield jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *pending)


def distribute_datasets_from_function(
    strategy, dataset_fn: Callable[[InputContext], Any], options=None
) -> DistributedDataset:
    options = _options(options)
    if not callable(dataset_fn):
        raise TypeError(
            f"`dataset_fn` must be callable. Received: dataset_fn={dataset_fn!r}."
        )
    context = strategy._input_context()
    dataset = dataset_fn(context)
    if _is_tf_dataset(dataset):
        _check_batched(
            dataset,
            "the dataset returned by dataset_fn",
            "Batch it by the per-replica batch size: `dataset.batch("
            "input_context.get_per_replica_batch_size(global_batch_size))`.",
        )
    start = _host_batches(dataset)
    group = strategy._local_replicas()
    return DistributedDataset(
        strategy,
        lambda: _grouped(start(), group),
        options=options,
        source=f"{type(dataset).__name__} from {getattr(dataset_fn, '__name__', 'fn')}",
        per_process=True,
    )
