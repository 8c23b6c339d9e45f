"""Where data goes: laying batches out over a strategy's mesh (one process or many)."""

import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist.data import _sparse
from keras_dist.data._input_context import InputOptions
from keras_dist.strategies._pacing import Pacer

__all__ = ["BATCH_AXIS", "Placement"]

BATCH_AXIS = "batch"


class Placement:
    """The input side of a strategy: shardings and per-process rows.

    A collaborator every `Strategy` owns (`strategy.placement`), not a mixin,
    and the strategy as the input layer sees it: it implements
    `keras_dist/data/_target.InputTarget`, and the input pipeline
    (`keras_dist/data/_pipeline.py`) talks to nothing else of a strategy.
    The pipeline reads, checks and pads batches; the placement says which
    rows live on this process (`process_rows`) and lays them out over the
    mesh (`shard`). Device-resident datasets: `_resident_placement`.

    Args:
        mesh: the strategy's 1-D `jax.sharding.Mesh` (axis `"batch"`).
        state_layout: the strategy's `StateLayout` (a batch is told from a
            split variable by its layout only when no state is split).
        pacer: the strategy's `Pacer` (programs in flight on CPU devices).
    """

    def __init__(self, mesh: jax.sharding.Mesh, state_layout: Any, pacer: Pacer):
        self.mesh = mesh
        self.devices: tuple[jax.Device, ...] = tuple(mesh.devices.flat)
        self.state_layout = state_layout
        self.pacer = pacer
        self.input_options = InputOptions()
        self._replicated = state_layout.replicated
        here = jax.process_index()
        # Computed once: the input path uses them for every batch.
        self._local_replica_count = sum(d.process_index == here for d in self.devices)
        self._process_count = len({d.process_index for d in self.devices})
        self.spans_processes = self._process_count > 1
        self._data_shardings: dict[int, NamedSharding] = {}
        self._row_ranges: dict[int, slice] = {}
        # ids of the batches `shard` laid out, while they live.
        self._laid_out_batches: dict[int, None] = {}
        self._step_numbers: list[jax.Array] = []  # `step_numbers`, kept.
        self._step_ranges: dict[tuple[int, int], jax.Array] = {}  # `step_range`.

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas a global batch is split over (all processes)."""
        return len(self.devices)

    def is_batch_sharded(self, array: jax.Array) -> bool:
        """Whether `array` is a global batch split over the replicas.

        A variable split along its first axis (FSDP, a partitioner, ZeRO-1
        slots) has the layout of a batch; when the strategy splits state, a
        batch is only what `shard` laid out.
        """
        # Called for every leaf of every `run`: cheap spec test first.
        sharding = getattr(array, "sharding", None)
        if not isinstance(sharding, NamedSharding) or array.ndim == 0:
            return False
        spec = tuple(sharding.spec)
        first = spec[0] if spec else None
        first = first if isinstance(first, tuple) else (first,)
        if first != (BATCH_AXIS,) or any(s is not None for s in spec[1:]):
            return False
        if not (sharding.mesh is self.mesh or sharding.mesh == self.mesh):
            return False
        return not self.state_layout.splits_state or id(array) in self._laid_out_batches

    def replicate(self, array) -> jax.Array:
        """`array` laid out whole on every device (unchanged if it already is)."""
        if isinstance(array, jax.Array) and (
            array.sharding == self._replicated
            or array.sharding.is_equivalent_to(self._replicated, array.ndim)
        ):
            return array
        return jax.device_put(array, self._replicated)

    def _remember_batches(self, arrays: list) -> None:
        for array in arrays:
            if isinstance(array, jax.Array) and not _sparse.is_sparse(array):
                key = id(array)
                self._laid_out_batches[key] = None
                weakref.finalize(array, self._laid_out_batches.pop, key, None)

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

    @property
    def num_local_replicas(self) -> int:
        """Replicas on this process's devices (all of them with one process)."""
        return self._local_replica_count

    @property
    def num_processes(self) -> int:
        """How many processes hold the strategy's devices (1 on one host)."""
        return self._process_count

    @property
    def process_id(self) -> int:
        """This process's index among the strategy's processes, from 0."""
        processes = sorted({d.process_index for d in self.devices})
        return processes.index(jax.process_index())

    def process_rows(self, rows: int) -> slice:
        """The rows of a global batch of `rows` rows that live on this process."""
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

    def shard(self, data: Any, rows: int | None = None) -> Any:
        """Lays this process's rows of a batch out over the mesh: global arrays.

        The input pipeline's last step (it reads, checks and pads first).

        Args:
            data: a pytree of arrays whose leading (batch) dimension is a
                multiple of `num_local_replicas`.
            rows: the global batch size, when the mesh spans processes.
        """
        leaves, treedef = jax.tree.flatten(data, is_leaf=_sparse.is_leaf)
        arrays = [_as_array(x) for x in leaves]
        if not self.spans_processes:
            # A sparse matrix is replicated (its children count stored
            # entries, not rows: `_sparse`).
            placed = [
                _place(
                    a,
                    self._replicated
                    if _sparse.is_sparse(a)
                    else self._data_sharding(a.ndim),
                )
                for a in arrays
            ]
        else:
            placed = [
                _sparse.place_sparse(a, self.mesh)
                if _sparse.is_sparse(a)
                else jax.make_array_from_process_local_data(
                    self._data_sharding(a.ndim),
                    a,
                    (rows, *a.shape[1:]) if a.ndim else None,
                )
                for a in arrays
            ]
        if self.state_layout.splits_state:
            self._remember_batches(placed)
        return jax.tree.unflatten(treedef, placed)

    def shard_steps(self, data: Any) -> Any:
        """Lays out the batches of several steps at once: one transfer.

        Args:
            data: a pytree of arrays `(steps, rows, ...)`: `steps` batches
                stacked, each as `shard` takes it. One process only.

        Returns:
            Arrays split along their second axis (the rows), so the batch
            of each step is laid out as `shard` lays it out.
        """
        if self.spans_processes:
            raise ValueError(
                "`shard_steps` lays out batches of one process only. Received a "
                f"strategy over {self._process_count} processes; use `shard` for "
                "each batch."
            )
        arrays, treedef = jax.tree.flatten(data)
        arrays = [_as_array(x) for x in arrays]
        placed = [_place(a, self._steps_sharding(a.ndim)) for a in arrays]
        return jax.tree.unflatten(treedef, placed)

    def _steps_sharding(self, ndim: int) -> NamedSharding:
        return NamedSharding(
            self.mesh, PartitionSpec(None, BATCH_AXIS, *([None] * (ndim - 2)))
        )


def _place(array, sharding: NamedSharding) -> jax.Array:
    """`array` laid out with `sharding` (addressable devices only).

    On the critical path of each step. A NumPy array goes through
    `make_array_from_callback`: the transfer `device_put` ends in
    (`batched_device_put` of the same slices, dtypes made canonical alike)
    with less Python around it.
    """
    if isinstance(array, np.ndarray):
        return jax.make_array_from_callback(array.shape, sharding, array.__getitem__)
    return jax.device_put(array, sharding)


def _as_array(leaf):
    if _sparse.is_sparse(leaf):
        return _sparse.to_bcoo(leaf)
    return leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
