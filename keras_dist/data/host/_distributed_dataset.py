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

from keras_dist.data._input_context import InputContext, InputOptions
from keras_dist.data._target import InputTarget
from keras_dist.data._tf_data import is_tf_dataset
from keras_dist.data.checks import _input_checks
from keras_dist.data.host._auto_shard import is_per_process, per_process_share
from keras_dist.data.host._pipeline import InputPass

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "distribute_dataset",
    "distribute_datasets_from_function",
]


class _OnePass:
    """Starts the one pass over an iterator (`one_shot`: no second pass)."""

    one_shot = True

    def __init__(self, iterator: Iterator[Any]):
        self._iterator = iterator

    def __call__(self) -> Iterator[Any]:
        return self._iterator


def _host_batches(dataset: Any) -> Callable[[], Iterator[Any]]:
    """A function that starts a new pass over `dataset`, yielding host batches."""
    if is_tf_dataset(dataset):
        return dataset.as_numpy_iterator
    if isinstance(dataset, Iterator):
        # One pass only: it is an iterator already. Nothing may read ahead of
        # the user's loop (what it took could never be given back).
        return _OnePass(dataset)
    if isinstance(dataset, Iterable):
        return lambda: iter(dataset)
    raise TypeError(
        "The dataset must be a `tf.data.Dataset` or an iterable of batches. "
        f"Received: dataset of type {type(dataset).__name__}."
    )


class DistributedIterator:
    """An iterator over global, replica-split batches; `next()` or `get_next()`.

    One pass of the input pipeline (`_pipeline.InputPass`) with the batches in
    the dataset's own structure.

    Example:

    ```python
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    first = next(iterator)
    second = iterator.get_next()  # tf's name
    ```
    """

    def __init__(
        self,
        strategy: InputTarget,
        host_iterator: Iterator[Any],
        options: InputOptions,
        source: str,
        per_process: bool = False,
        replayable: bool = True,
    ):
        prefetch = 0
        if options.experimental_fetch_to_device and replayable:
            prefetch = options.experimental_per_replica_buffer_size
        self._pass = InputPass(
            strategy,
            host_iterator,
            source=source,
            per_process=per_process,
            keras=False,
            prefetch=prefetch,
        )

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        return next(self._pass)

    def get_next(self) -> Any:
        """The next global batch; raises `StopIteration` at the end."""
        return next(self)

    def close(self) -> None:
        """Stops the prefetch thread (also done when garbage collected)."""
        self._pass.close()


class DistributedDataset:
    """An iterable of global batches split over a strategy's replicas.

    Each `iter()` starts a new pass over the underlying dataset.

    Example:

    ```python
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)  # global
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    for epoch in range(2):
        for batch in dist_dataset:  # each iter() is a new pass
            strategy.run(step, args=(batch,))
    ```
    """

    def __init__(
        self,
        strategy: InputTarget,
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
            replayable=not getattr(self._start_pass, "one_shot", False),
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


def distribute_dataset(
    strategy: InputTarget, dataset: Any, options: InputOptions | None = None
) -> DistributedDataset:
    options = _options(options)
    checks: dict[str, Any] = {"argument": "dataset", "per_replica": False}
    _input_checks.check_dataset(dataset, **checks)
    source = type(dataset).__name__
    dataset = per_process_share(strategy, dataset)
    return DistributedDataset(
        strategy,
        _input_checks.first_element_checked(_host_batches(dataset), dataset, **checks),
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
    strategy: InputTarget,
    dataset_fn: Callable[[InputContext], Any],
    options: InputOptions | None = None,
) -> DistributedDataset:
    options = _options(options)
    if not callable(dataset_fn):
        raise TypeError(
            f"`dataset_fn` must be callable. Received: dataset_fn={dataset_fn!r}."
        )
    context = InputContext(
        num_input_pipelines=strategy.num_processes,
        input_pipeline_id=strategy.process_id,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )
    dataset = dataset_fn(context)
    checks: dict[str, Any] = {
        "argument": "dataset_fn(input_context)",
        "per_replica": True,
    }
    _input_checks.check_dataset(dataset, **checks)
    start = _input_checks.first_element_checked(
        _host_batches(dataset), dataset, **checks
    )
    group = strategy.num_local_replicas
    return DistributedDataset(
        strategy,
        lambda: _grouped(start(), group),
        options=options,
        source=f"{type(dataset).__name__} from {getattr(dataset_fn, '__name__', 'fn')}",
        per_process=True,
    )
