"""Where data goes: laying batches out over a strategy's mesh (one process or many)."""

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist.data import _auto_shard
from keras_dist.data._input_context import InputContext

__all__ = ["BATCH_AXIS", "Placement"]

BATCH_AXIS = "batch"


class Placement:
    """The input side of `Strategy`: shardings and per-process rows.

    The input pipeline (`keras_dist/data/_pipeline.py`) reads, checks and pads
    batches; a strategy only says which rows live on this process
    (`_process_rows`) and lays them out over its mesh (`_shard`).

    A mixin: `Strategy.__init__` sets `mesh`, `_replicated`, `_data_shardings`,
    `_row_ranges`, `_process_count`, `_spans_processes`, `_local_replica_count`.
    """

    # Placement helpers ------------------------------------------------------

    def _is_batch_sharded(self, array: jax.Array) -> bool:
        # Called for every leaf of every `run`: cheap spec test first.
        sharding = getattr(array, "sharding", None)
        if not isinstance(sharding, NamedSharding) or array.ndim == 0:
            return False
        spec = tuple(sharding.spec)
        first = spec[0] if spec else None
        first = first if isinstance(first, tuple) else (first,)
        if first != (BATCH_AXIS,) or any(s is not None for s in spec[1:]):
            return False
        return sharding.mesh is self.mesh or sharding.mesh == self.mesh

    def _replicate(self, array) -> jax.Array:
        if isinstance(array, jax.Array) and (
            array.sharding == self._replicated
            or array.sharding.is_equivalent_to(self._replicated, array.ndim)
        ):
            return array
        return jax.device_put(array, self._replicated)

    def _data_sharding(self, ndim: int) -> NamedSharding:
        sharding = self._data_shardings.get(ndim)
        if sharding is None:
            spec = (
                PartitionSpec(BATCH_AXIS, *([None] * (ndim - 1)))
                if ndim
                else PartitionSpec()
            )
            sharding = self._data_shardings[ndim] = NamedSharding(self.mesh, spec)
        return sharding

    def _local_replicas(self) -> int:
        return self._local_replica_count

    def _input_context(self) -> InputContext:
        processes = sorted({d.process_index for d in self.devices})
        return InputContext(
            num_input_pipelines=len(processes),
            input_pipeline_id=processes.index(jax.process_index()),
            num_replicas_in_sync=self.num_replicas_in_sync,
        )

    def _process_rows(self, rows: int) -> slice:
        """The rows of a global batch of `rows` that live on this process."""
        found = self._row_ranges.get(rows)
        if found is None:
            indices = self._data_sharding(1).addressable_devices_indices_map((rows,))
            starts = [index[0].start or 0 for index in indices.values()]
            stops = [
                rows if index[0].stop is None else index[0].stop
                for index in indices.values()
            ]
            found = self._row_ranges[rows] = slice(min(starts), max(stops))
        return found

    def _shard(self, data: Any, rows: int | None = None) -> Any:
        """This process's rows (a multiple of its replicas) -> global arrays.

        `rows` is the global batch size when the mesh spans processes.
        """
        leaves, treedef = jax.tree.flatten(data)
        arrays = [x if isinstance(x, jax.Array) else np.asarray(x) for x in leaves]
        shardings = [self._data_sharding(a.ndim) for a in arrays]
        if not self._spans_processes:
            # One batched transfer for every array of the batch: the layout is
            # on the critical path of each step.
            return jax.tree.unflatten(treedef, jax.device_put(arrays, shardings))
        return jax.tree.unflatten(
            treedef,
            [
                jax.make_array_from_process_local_data(
                    sharding, a, (rows, *a.shape[1:]) if a.ndim else None
                )
                for a, sharding in zip(arrays, shardings, strict=True)
            ],
        )

    def distribute_dataset(self, dataset):
        """Keras's hook for tf.data inputs of fit/evaluate/predict.

        With one process, or under `AutoShardPolicy.AUTO/DATA`, the dataset
        is kept whole (each process reads every global batch and keeps its
        rows). Under `FILE` or `OFF` it becomes this process's share, read
        `global_batch / num_processes` rows per step.
        """
        return _auto_shard.per_process_share(self, dataset)
