"""Seams on Keras's data adapters: what keras_dist reads from them, and changes.

**In-memory arrays as a device-resident dataset** (`resident_pass`,
`data/resident/_resident.py`). Reads the private parts of Keras's `ArrayDataAdapter`
that the public API does not show: its arrays (`_inputs`, converted as Keras
converts them for JAX, `array_slicing.convert_to_sliceable`) and its
batching (`_get_iterator`), which is run with a slicing function that
returns the indices instead of the rows. So the index batches are Keras's
own: the same `np.random.permutation` calls at the same moments for
`shuffle=True` and `"batch"`, the same partial last batch.

**A tf.data dataset split per process** (`tf_dataset_adapter_init`). Keras
3.15 asked the distribution for the dataset each process reads
(`DataParallel.distribute_dataset`); Keras 3.16 dropped that hook and shards
inside its adapters, only with `auto_shard_dataset=True` (which keras_dist
keeps off: Keras's sharding needs a global batch divisible by the processes
and loses the exact partial batch). So the one place that works on both is
Keras's tf.data adapter itself: after `TFDatasetAdapter.__init__`, under a
keras_dist strategy, the adapter reads this process's share
(`data/host/_auto_shard.per_process_share`: the whole dataset under AUTO/DATA).
"""

from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np
from keras.src.trainers.data_adapters.array_slicing import convert_to_sliceable

from keras_dist._private_api._wrapped import marked
from keras_dist.data import _call
from keras_dist.data._target import InputTarget
from keras_dist.data.host._auto_shard import per_process_share
from keras_dist.data.resident._resident import KeptPass, ResidentPass
from keras_dist.data.resident._resident_data import lay_out_resident, resident_layout
from keras_dist.strategies._base import Strategy

__all__ = [
    "ARRAY_ADAPTER",
    "adapter_dataset",
    "resident_pass",
    "tf_dataset_adapter_init",
]

# The adapter `resident_pass` reads (by name: the class is private).
ARRAY_ADAPTER = "ArrayDataAdapter"
# Stands for the whole input in `_get_iterator`: one leaf, so each batch is
# the slicing function's result for it (the indices).
_ONE_LEAF = object()


def resident_pass(adapter: Any, strategy: InputTarget) -> ResidentPass | None:
    """A pass over `adapter` gathered on the devices, or None for the host path."""
    if type(adapter).__name__ != ARRAY_ADAPTER or strategy.num_processes > 1:
        return None
    options = strategy.input_options
    leaves = [leaf for leaf in keras.tree.flatten(adapter._inputs) if leaf is not None]
    if options.device_resident is False or not all(map(_is_dense, leaves)):
        return None
    call = _call.active()
    cache = call.root.resident if call is not None else {}
    found = cache.get(id(adapter))
    if found is None:
        total = sum(_bytes_of(leaf) for leaf in leaves)
        block_rows = _blocks(adapter, strategy)
        layout = resident_layout(
            options,
            total,
            strategy.num_replicas_in_sync,
            in_order=block_rows is not None,
            splittable=_splittable(adapter, strategy),
            devices=strategy.devices,
        )
        if layout is None:
            return None
        rows = _rows(adapter)
        if call is not None and call.check_batch is not None:
            call.check_batch(rows, 0)  # What the host path checks batch by batch.
        # Without a shuffle every pass reads the same batches: the first
        # pass reads and lays them out, the others take what it kept.
        found = (
            adapter,
            lay_out_resident(strategy, rows, layout, block_rows=block_rows),
            None if adapter._shuffle else KeptPass(),
        )
        cache[id(adapter)] = found
    kept = found[2]
    # Keras draws a `shuffle="batch"` order as it reads each batch.
    read_ahead = adapter._shuffle != "batch"
    return ResidentPass(
        strategy,
        found[1],
        _index_batches(adapter),
        call=call,
        read_ahead=read_ahead,
        kept=kept,
    )


def _blocks(adapter: Any, strategy: InputTarget) -> int | None:
    """The batch size, when every pass reads the data in order in full batches.

    Then the data is laid out as blocks split over the replicas, 1/replicas
    of it on each device (`Placement.lay_out_blocks`), instead of a copy on
    every device: `evaluate`, `predict`, validation data, `fit(shuffle=False)`.
    """
    size = adapter._batch_size
    if (
        adapter._shuffle
        or not size
        or size % strategy.num_replicas_in_sync
        or adapter._num_samples < size
    ):
        return None
    return size


def _splittable(adapter: Any, strategy: InputTarget) -> bool:
    """Whether the data can be split over the replicas by rows (`ROWS`).

    What `fit` shuffles whole: each pass (epoch) then lays its batches out
    from the rows once (`Placement.exchange_rows`). Keras draws a
    `shuffle="batch"` order as it reads each batch, with no pass to lay out
    ahead.
    """
    size = adapter._batch_size
    return (
        bool(adapter._shuffle)
        and adapter._shuffle != "batch"
        and bool(size)
        and size % strategy.num_replicas_in_sync == 0
    )


def _is_dense(leaf: Any) -> bool:
    """A NumPy or dense JAX array of numbers, with rows."""
    if isinstance(leaf, jax.Array):
        return leaf.ndim > 0
    return isinstance(leaf, np.ndarray) and leaf.ndim > 0 and leaf.dtype.kind in "biufc"


def _bytes_of(leaf: Any) -> int:
    """Bytes of `leaf` on the devices: floats are cast to `floatx` (as Keras)."""
    dtype = np.dtype(leaf.dtype)
    if dtype.kind == "f":
        dtype = np.dtype(keras.backend.floatx())
    return int(np.prod(leaf.shape)) * dtype.itemsize


def _rows(adapter: Any) -> Any:
    """Every row of the adapter's input, as its batches have them."""
    sliceables = convert_to_sliceable(adapter._inputs, target_backend="jax")
    everything = slice(0, adapter._num_samples)
    return keras.tree.map_structure(
        lambda s: s.convert_to_jax_compatible(s[everything]),
        sliceables,
        none_is_leaf=False,
    )


def _index_batches(adapter: Any):
    """Keras's batches of the adapter, as row indices (a slice or an array)."""
    return adapter._get_iterator(_indices_only, _ONE_LEAF)


def _indices_only(leaf: Any, indices: Any = None) -> Any:
    return indices


def tf_dataset_adapter_init(original: Callable) -> Callable:
    """Wraps `TFDatasetAdapter.__init__(self, dataset, class_weight, distribution)`."""

    def __init__(
        self,
        dataset,
        class_weight=None,
        distribution: Any = None,
    ):
        original(self, dataset, class_weight=class_weight, distribution=distribution)
        if isinstance(distribution, Strategy):
            self._dataset = per_process_share(distribution.placement, self._dataset)

    marked(__init__, original)
    return __init__


def adapter_dataset(adapter: Any) -> Any:
    """The dataset a Keras data adapter reads (tf.data adapters), or None."""
    return getattr(adapter, "_dataset", None)
