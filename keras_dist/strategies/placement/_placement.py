"""Where data goes and how far ahead: batches laid out over a strategy's mesh.

`Placement` lays batches out over the mesh (one process or many); its
`Pacer` bounds how many programs the host may dispatch ahead of the devices.

**Enough threads, and a few programs in flight, on CPU devices (XLA:CPU
collective deadlock).** JAX dispatches a program and returns before it
runs. XLA:CPU launches a program of several devices as one task per device
on its client's thread pool, and a launch waits there, holding its thread,
while its device has 32 programs in flight. The pool has max(CPU cores,
devices) threads and a collective (the gradients' all-reduce) needs one per
device at once: with 8 virtual devices on 2 cores, the launches of the next
program can hold the threads the running all-reduce needs, and XLA aborts
the process 40 s later ("Expected 8 threads to join the rendezvous, but only
7 of them arrived"). A flood of programs does it: a few hundred fast steps,
or the many small programs of an eager step (`run_eagerly=True`), the
sooner the more loaded the machine. Two guards:

- `keras_dist/_backend.size_cpu_thread_pool` gives the pool 3 threads a
  device (`PJRT_NPROC`) when keras_dist is imported before JAX starts;
  `Pacer` warns once when JAX started with fewer.
- `Pacer.after(outputs)` is called with the outputs of each program the host
  dispatches every step (each step of Keras's loops, `strategy.run`,
  `reduce`, `gather`); on a strategy over more than one CPU device it then
  waits until the program `DEPTH` dispatches earlier has finished, so the
  host does not run far ahead of the devices (that only competes with their
  threads for the cores). On one device, GPUs and TPUs it does nothing.
  Waiting for a program that finished long ago costs microseconds.

`python benchmarks/cpu_thread_flood.py 15000` floods the pool (eager
all-reduces on 8 devices); `python benchmarks/single_vs_mirrored.py
--configs B,BU,EK,EKU` measures what the pacing costs a step.
"""

import collections
import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist import _backend
from keras_dist.data import _sparse
from keras_dist.data._input_context import InputOptions
from keras_dist.strategies.devices._lay_out import lay_out
from keras_dist.strategies.devices._mesh import BATCH_AXIS

__all__ = [
    "DEPTH",
    "BatchRows",
    "Pacer",
    "Placement",
    "batch_rows_of",
    "num_real_of",
]


DEPTH = 8

# The attribute a global batch laid out for user code carries (below).
_ROWS_ATTRIBUTE = "__keras_dist_rows__"


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """What a laid-out global batch array says of itself.

    `Placement.lay_out` sets it on each array it lays out for user code
    (distributed datasets) and, when the strategy splits state, on every
    batch: the array *is* a batch (not a variable split the same way) and
    `num_real` of its rows are real (`_partial_batch.NumReal`; None: all).
    It lives on the array, so it goes where the array goes (users' own
    containers, `tree` utilities, copies of the container) and dies with it:
    no table keyed by identity.

    Attributes:
        num_real: the real rows of a padded batch, or None.
    """

    num_real: Any = None


def batch_rows_of(array: Any) -> BatchRows | None:
    """The `BatchRows` of a laid-out batch array, or None."""
    return getattr(array, _ROWS_ATTRIBUTE, None)


def num_real_of(array: Any) -> Any:
    """The real rows a laid-out batch array carries (`NumReal`), or None: all."""
    rows = getattr(array, _ROWS_ATTRIBUTE, None)
    return None if rows is None else rows.num_real


def _mark(arrays: list, rows: BatchRows) -> None:
    for array in arrays:
        if isinstance(array, jax.Array) and not _sparse.is_sparse(array):
            setattr(array, _ROWS_ATTRIBUTE, rows)


class Pacer:
    """Keeps at most `DEPTH` programs in flight, on CPU devices only.

    Args:
        devices: the devices the programs run on.
    """

    def __init__(self, devices):
        devices = list(devices)
        self.enabled = len(devices) > 1 and all(d.platform == "cpu" for d in devices)
        self._in_flight: collections.deque = collections.deque()
        if self.enabled:
            _warn_if_few_threads(devices)

    def after(self, outputs: Any) -> None:
        """`outputs` were just dispatched; waits for the program `DEPTH` back."""
        if not self.enabled:
            return
        marker = _first_array(outputs)
        if marker is None:
            return
        self._in_flight.append(marker)
        if len(self._in_flight) > DEPTH:
            oldest = self._in_flight.popleft()
            if not oldest.is_deleted():
                oldest.block_until_ready()


_WARNED: set = set()


def _warn_if_few_threads(devices: list) -> None:
    """Once per device count: JAX started with too few XLA:CPU threads."""
    local = sum(d.process_index == jax.process_index() for d in devices)
    wanted = _backend.THREADS_PER_CPU_DEVICE * local
    if local < 2 or local in _WARNED or _backend.cpu_client_threads(local) >= wanted:
        return
    _WARNED.add(local)
    warnings.warn(
        f"JAX started its CPU client with {_backend.cpu_client_threads(local)} "
        f"threads for {local} CPU devices; XLA:CPU can then deadlock in a "
        'collective and abort the process ("Expected N threads to join the '
        'rendezvous"). Import keras_dist before anything starts JAX (it then '
        f"sets PJRT_NPROC={wanted}), or set PJRT_NPROC={wanted} in the "
        "environment.",
        RuntimeWarning,
        stacklevel=4,
    )


def _first_array(outputs: Any) -> jax.Array | None:
    """The first concrete array of `outputs` (not a tracer: a traced call).

    Walks containers only until it finds one: a step's outputs begin with
    its logs, and its whole state need not be flattened every step.
    """
    stacked = getattr(outputs, "stacked", None)  # A `PerReplica`: its array.
    if isinstance(stacked, jax.Array):
        outputs = stacked
    if isinstance(outputs, jax.Array):
        return outputs if hasattr(outputs, "is_deleted") else None
    if isinstance(outputs, dict):
        outputs = outputs.values()
    elif not isinstance(outputs, (list, tuple)):
        # Another pytree (a dataclass, a registered class): its leaves. A
        # leaf that is not an array (None, a number, a tracer's) ends here.
        leaves = jax.tree.leaves(outputs)
        if leaves == [outputs]:
            return None
        outputs = leaves
    for item in outputs:
        found = _first_array(item)
        if found is not None:
            return found
    return None


_UNPADDED = BatchRows()


class Placement:
    """The input side of a strategy: shardings and per-process rows.

    A collaborator every `Strategy` owns (`strategy.placement`), not a mixin,
    and the strategy as the input layer sees it: it implements
    `keras_dist/data/_target.InputTarget`, and the input pipeline
    (`keras_dist/data/host/_pipeline.py`) talks to nothing else of a strategy.
    The pipeline reads, checks and pads batches; the placement says which
    rows live on this process (`process_rows`) and lays them out over the
    mesh (`lay_out`). Device-resident datasets: `_resident_placement`.

    Args:
        mesh: the strategy's `jax.sharding.Mesh` (axes `("batch",)` or
            `("batch", "model")`; batches are split over `"batch"`).
        state_layout: the strategy's `StateLayout` (a batch is told from a
            split variable by its layout only when no state is split).

    Attributes:
        devices: the devices of the mesh (all processes), in mesh order.
        replica_devices: the first device of each replica (a mesh row), in
            replica order.
        num_replicas_in_sync: replicas a global batch is split over (all
            processes).
        num_local_replicas: replicas on this process's devices (all of them
            with one process).
        num_processes: how many processes hold the devices (1 on one host).
        spans_processes: whether that is more than one.
        pacer: the `Pacer` of the programs the strategy runs on the devices.
        input_options: how `fit`/`evaluate`/`predict` bring their input to
            the devices (`kd.InputOptions`).
    """

    def __init__(self, mesh: jax.sharding.Mesh, state_layout: Any):
        self.mesh = mesh
        self.devices: tuple[jax.Device, ...] = tuple(mesh.devices.flat)
        self.state_layout = state_layout
        self.pacer = Pacer(self.devices)
        self.input_options = InputOptions()
        self._replicated = state_layout.replicated
        here = jax.process_index()
        # Plain attributes: the input path reads them for every batch, and
        # a mesh does not change.
        # A replica is a row of the mesh: one device with data parallelism
        # only, `model_parallel` devices of one process on a 2-D mesh.
        rows = mesh.devices.reshape(mesh.devices.shape[0], -1)
        self.replica_devices: tuple[jax.Device, ...] = tuple(rows[:, 0])
        self.num_replicas_in_sync = len(self.replica_devices)
        self.num_local_replicas = sum(
            d.process_index == here for d in self.replica_devices
        )
        self.num_processes = len({d.process_index for d in self.devices})
        self.spans_processes = self.num_processes > 1
        # Whether a batch is told from a split variable by its mark (below).
        self._splits_state = state_layout.splits_state
        self._data_shardings: dict[int, NamedSharding] = {}
        self._row_ranges: dict[int, slice] = {}
        self._step_numbers: list[jax.Array] = []  # `step_numbers`, kept.
        self._step_ranges: dict[tuple[int, int], jax.Array] = {}  # `step_range`.

    def is_batch_sharded(self, array: jax.Array) -> bool:
        """Whether `array` is a global batch split over the replicas.

        A variable split along its first axis (FSDP, a partitioner, ZeRO-1
        slots) has the layout of a batch; when the strategy splits state, a
        batch is only what `lay_out` laid out (it carries `BatchRows`).
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
        return not self._splits_state or batch_rows_of(array) is not None

    def replicate(self, array) -> jax.Array:
        """`array` laid out whole on every device (unchanged if it already is)."""
        if isinstance(array, jax.Array) and (
            array.sharding == self._replicated
            or array.sharding.is_equivalent_to(self._replicated, array.ndim)
        ):
            return array
        return lay_out(array, self._replicated)

    def _remember_batches(self, arrays: list, num_real: Any = None) -> None:
        """Marks laid-out batch arrays (`BatchRows`) where someone asks."""
        if num_real is not None or self._splits_state:
            _mark(arrays, _UNPADDED if num_real is None else BatchRows(num_real))

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
    def process_id(self) -> int:
        """This process's index among the strategy's processes, from 0."""
        processes = sorted({d.process_index for d in self.devices})
        return processes.index(jax.process_index())

    def process_rows(self, rows: int) -> slice:
        """The rows of a global batch of `rows` rows that live on this process."""
        found = self._row_ranges.get(rows)
        if found is None:
            found_indices = self._data_sharding(1).addressable_devices_indices_map(
                (rows,)
            )
            # A NamedSharding gives every device its index (never None).
            indices = [index for index in found_indices.values() if index is not None]
            starts = [index[0].start or 0 for index in indices]
            stops = [
                rows if index[0].stop is None else index[0].stop for index in indices
            ]
            found = self._row_ranges[rows] = slice(min(starts), max(stops))
        return found

    def lay_out(
        self, data: Any, rows: int | None = None, *, num_real: Any = None
    ) -> Any:
        """Lays this process's rows of a batch out over the mesh: global arrays.

        The input pipeline's last step (it reads, checks and pads first).

        Args:
            data: a pytree of arrays whose leading (batch) dimension is a
                multiple of `num_local_replicas`.
            rows: the global batch size, when the mesh spans processes.
            num_real: the real rows of a padded batch handed to user code
                (`_partial_batch.NumReal`): each array carries them
                (`BatchRows`), for `run`, `reduce` and `gather`.
        """
        leaves, treedef = jax.tree.flatten(data)
        if not self.spans_processes and all(
            type(leaf) is np.ndarray for leaf in leaves
        ):  # A dense host batch (the common case): no sparse walk.
            placed: list[Any] = [_place(a, self._data_sharding(a.ndim)) for a in leaves]
            self._remember_batches(placed, num_real)
            return jax.tree.unflatten(treedef, placed)
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
        self._remember_batches(placed, num_real)
        return jax.tree.unflatten(treedef, placed)

    def lay_out_steps(self, data: Any) -> Any:
        """Lays out the batches of several steps at once: one transfer.

        Args:
            data: a pytree of arrays `(steps, rows, ...)`: `steps` batches
                stacked, each as `lay_out` takes it. One process only.

        Returns:
            Arrays split along their second axis (the rows), so the batch
            of each step is laid out as `lay_out` lays it out.
        """
        if self.spans_processes:
            raise ValueError(
                "`lay_out_steps` lays out batches of one process only. Received a "
                f"strategy over {self.num_processes} processes; use `lay_out` for "
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
    return lay_out(array, sharding)


def _as_array(leaf):
    if _sparse.is_sparse(leaf):
        return _sparse.to_bcoo(leaf)
    return leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
