"""`Strategy`: a Keras 3 distribution that speaks tf.distribute."""

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import keras

from keras_dist._private_api import _access
from keras_dist.cluster import _sync
from keras_dist.cluster._environment import unjoined_cluster
from keras_dist.data._input_context import InputOptions
from keras_dist.data.host import _distributed_dataset
from keras_dist.errors import ProcessMismatchError, StrategyMismatchError
from keras_dist.strategies._moved import install_moved_methods
from keras_dist.strategies.devices._any_shape import data_layout
from keras_dist.strategies.devices._devices import device_name
from keras_dist.strategies.devices._mesh import (
    BATCH_AXIS,
    build_device_mesh,
    made_layout_map,
)
from keras_dist.strategies.placement._placement import Pacer
from keras_dist.strategies.placement._resident_placement import ResidentPlacement
from keras_dist.strategies.replica import _cross_replica, _run
from keras_dist.strategies.replica._values import ReduceOp
from keras_dist.strategies.state import _ownership
from keras_dist.strategies.state._memory_report import MemoryReport, memory_report
from keras_dist.strategies.state._state_layout import StateLayout

__all__ = ["Strategy", "strategy_of_model", "strategy_of_variable"]

strategy_of_model = _ownership.strategy_of_model
strategy_of_variable = _ownership.strategy_of_variable


def _say_if_alone(strategy: "Strategy") -> None:
    """Warns when a one-process strategy is made in one process of a cluster
    (keras-dist-run -n 2, TF_CONFIG, SLURM) that has not joined it: each
    process would train a model of its own and write its own files."""
    cluster = unjoined_cluster()
    if cluster is None:
        return
    name = type(strategy).__name__
    warnings.warn(
        f"{name} trains on this process's {len(strategy.devices)} device(s) "
        f"alone, but this process is {cluster.process_id} of "
        f"{cluster.num_processes} ({cluster.source}): each of the "
        f"{cluster.num_processes} processes would train a model of its own and "
        "write its own files. To train them as one, create "
        "`kd.MultiWorkerMirroredStrategy()` instead (it joins the processes); "
        "to train them apart on purpose, ignore this warning.",
        UserWarning,
        stacklevel=_outside_keras_dist(),
    )


def _outside_keras_dist() -> int:
    """The `stacklevel` of the first caller outside keras_dist (the user's
    line that created the strategy), for a `warnings.warn` of our caller."""
    frame, level = inspect.currentframe(), 0  # This function's.
    for _ in range(2):  # Our caller's caller: level 2 of its `warn`.
        frame, level = frame.f_back if frame else None, level + 1
    while (
        frame
        and frame.f_back
        and frame.f_globals.get("__name__", "").startswith("keras_dist.")
    ):
        frame, level = frame.f_back, level + 1
    return level


class Strategy(keras.distribution.DataParallel):
    """Base class of keras_dist strategies: a data-parallel Keras distribution.

    A strategy owns a `jax.sharding.Mesh`: 1-D with the axis `"batch"`, or
    2-D `("batch", "model")` with `model_parallel` devices per replica. Inside
    `strategy.scope()` every Keras variable is created on the mesh, replicated
    unless the strategy's `state_layout` splits it,
    and `model.fit/evaluate/predict` split each global batch over it. A model
    built in the scope remembers its strategy: calling `fit` outside the scope
    (as the tf.distribute tutorials do) still runs distributed.

    Use a concrete subclass: `MirroredStrategy` or `OneDeviceStrategy`.

    Example:

    ```python
    def train(strategy: kd.Strategy):  # any keras_dist strategy
        with strategy.scope():
            model = make_model()
            model.compile(optimizer="adam", loss="mse")
        return model.fit(x, y, batch_size=8 * strategy.num_replicas_in_sync)

    train(kd.MirroredStrategy())
    train(kd.OneDeviceStrategy("cpu:0"))
    ```

    Args:
        devices: the resolved `jax.Device`s of the replicas, in mesh order.
        state_layout: makes the strategy's `StateLayout` from its device mesh
            and name (`StateLayout(device_mesh, owner)`; on a 2-D mesh also
            `layout_map=`). Defaults to everything replicated.
        model_parallel: devices per replica, the `"model"` axis of a 2-D
            mesh `(N / k, k)`. Defaults to 1: data parallelism only.
        layout_map: a `keras.distribution.LayoutMap` (its mesh decides the
            shape), or a function making one from the strategy's
            `DeviceMesh` (keras-hub's `Backbone.get_layout_map`). Defaults
            to None: automatic layouts on a 2-D mesh.

    Attributes:
        placement: where this strategy's data goes, and what the input
            pipeline talks to (a `Placement`): lays batches out over the mesh
            (`lay_out`), says which rows live on this process, places
            device-resident datasets, paces the programs in flight. Input
            machinery: a user passes data to `fit` or
            `experimental_distribute_dataset`.
    """

    def __init__(
        self,
        devices: Sequence[jax.Device],
        *,
        state_layout: Callable[..., StateLayout] = StateLayout,
        model_parallel: int = 1,
        layout_map: Any = None,
    ):
        device_mesh = build_device_mesh(
            devices, model_parallel=model_parallel, layout_map=layout_map
        )
        # keras_dist splits the input over processes itself (keras.distribution
        # would rebatch tf.data and refuse NumPy with several processes). A
        # 2-D mesh splits data over its first axis, as DataParallel does with
        # one; its constructor cannot take one (its warning for a 2-D mesh is
        # a TypeError), so the distribution is set up by the class above it.
        super(keras.distribution.DataParallel, self).__init__(
            device_mesh, BATCH_AXIS, auto_shard_dataset=False
        )
        if callable(layout_map) and not isinstance(
            layout_map, keras.distribution.LayoutMap
        ):
            layout_map = made_layout_map(layout_map, self.device_mesh)
        self._layout_map = layout_map
        owner = type(self).__name__
        if len(self.device_mesh.axis_names) > 1:  # ("batch", "model")
            self._state_layout = state_layout(
                self.device_mesh, owner, layout_map=layout_map
            )
        else:
            self._state_layout = state_layout(self.device_mesh, owner)
        _ownership.register(self)
        self._run_cache: dict = {}
        # Where this strategy's data goes: what the input pipeline talks to.
        self.placement = ResidentPlacement(self.mesh, self._state_layout)
        if not self.spans_processes:
            _say_if_alone(self)

    @property
    def state_layout(self) -> StateLayout:
        """Where this strategy keeps variables and optimizer state.

        A `StateLayout` (replicated), or one that splits them (FSDP, ZeRO-1,
        a partitioner) or keeps them in host memory; `memory_report` shows
        the result.
        """
        return self._state_layout

    @property
    def num_local_replicas(self) -> int:
        """Replicas on this process's devices (all of them with one process)."""
        return self.placement.num_local_replicas

    @property
    def num_processes(self) -> int:
        """How many processes hold the strategy's devices (1 on one host)."""
        return self.placement.num_processes

    @property
    def process_id(self) -> int:
        """This process's index among the strategy's processes, from 0."""
        return self.placement.process_id

    @property
    def pacer(self) -> Pacer:
        """Bounds the programs in flight on CPU devices (nothing elsewhere)."""
        return self.placement.pacer

    @property
    def spans_processes(self) -> bool:
        """Whether the mesh has devices of several processes."""
        return self.placement.spans_processes

    def get_variable_layout(
        self, variable: keras.Variable
    ) -> keras.distribution.TensorLayout:
        """Keras's hook: the layout each new variable is created with.

        The `state_layout`'s. With several processes, each new variable is
        first checked to have the same shape and dtype on every process: JAX
        would otherwise abort in a collective when the processes build
        different models.
        """
        assigned = _access.assigned_layout(variable)
        if assigned is not None:  # As Keras's: a layout given at creation.
            return assigned
        if self.spans_processes:
            _check_same_variable(variable)
        return self._state_layout.variable_layout(variable)

    def memory_report(self, model: keras.Model) -> MemoryReport:
        """Bytes of `model`'s weights and optimizer state per device, and why.

        Example:

        ```python
        print(strategy.memory_report(model))   # a table, one row per variable
        ```

        Returns:
            A `MemoryReport`: totals per device and, for each variable, its
            layout (split axis and parts, or replicated and the reason),
            measured on the arrays' device buffers.
        """
        return memory_report(self, model)

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas the global batch is split over.

        Each replica is `model_parallel` devices holding one model.
        """
        return int(self.device_mesh.devices.shape[0])

    @property
    def num_model_replicas(self) -> int:
        """Keras's name for `num_replicas_in_sync`."""
        return self.num_replicas_in_sync

    @property
    def model_parallel(self) -> int:
        """Devices per replica: the size of the `"model"` axis (1: none)."""
        shape = self.device_mesh.devices.shape
        return int(shape[1]) if len(shape) > 1 else 1

    @property
    def layout_map(self) -> "keras.distribution.LayoutMap | None":
        """The `LayoutMap` whose rules lay variables out (None: automatic)."""
        return self._layout_map

    def get_data_layout(self, data_shape: Sequence[Any]) -> Any:
        """Keras's hook for a batch's layout, for a batch of any size.

        The first dimension split over `"batch"` when the replicas divide
        it; otherwise whole on every replica (Keras's `DataParallel` raises
        there): libraries that lay data out themselves, such as keras-hub's
        `CausalLM.generate` on 3 prompts over 8 replicas, get one device's
        numbers. `fit`, `evaluate` and `predict` pad a partial batch instead.
        """
        return data_layout(self.device_mesh, tuple(data_shape))

    def get_tensor_layout(self, path: str) -> Any:
        """Keras's hook for a layer output's layout: the layout map's rule."""
        if self._layout_map is None:
            return None
        return self._layout_map[path]

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The `jax.Device`s of the mesh, row by row (a replica's together)."""
        return tuple(self.device_mesh.devices.flat)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The `jax.sharding.Mesh` of this strategy: axes `("batch",)`, or
        `("batch", "model")` with `model_parallel`."""
        return self.device_mesh.backend_mesh

    @property
    def input_options(self) -> InputOptions:
        """How `fit`/`evaluate`/`predict` bring their input to the devices.

        A `kd.InputOptions`; e.g. `device_resident` for in-memory arrays.
        """
        return self.placement.input_options

    @input_options.setter
    def input_options(self, options: InputOptions) -> None:
        if not isinstance(options, InputOptions):
            raise TypeError(
                "`input_options` must be a `kd.InputOptions`. Received: "
                f"input_options={options!r}. Use e.g. "
                "`strategy.input_options = kd.InputOptions(device_resident=True)`."
            )
        self.placement.input_options = options

    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Makes this strategy current: variables created inside are replicated.

        Raises:
            StrategyMismatchError: if another distribution is already current.
        """
        current = keras.distribution.distribution()
        if current is not None and current is not self:
            raise StrategyMismatchError(
                f"Cannot enter the scope of {self!r} while {current!r} is the "
                "current distribution (entered with its `scope()` or set with "
                "`keras.distribution.set_distribution`). Mixing two strategies "
                "is not supported: leave the other scope first, or call "
                "`keras.distribution.set_distribution(None)`."
            )
        try:
            with super().scope():
                yield self
        finally:
            # Layout warnings (dimensions kept whole, variables no rule
            # matched) come once, for what was built in the scope.
            # Attributed to the user's `with` (1: here, 2: contextlib's exit).
            self._state_layout.take_warnings(stacklevel=3)

    def check_global_batch(self, batch_size: int) -> None:
        """Called with each `batch_size` of a call; a strategy may warn."""

    # The replica API (tf.distribute's names) ------------------------------

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs `fn` once per replica, each on its shard of the batch.

        Arguments that are global batches split over the replicas (the
        elements of `experimental_distribute_dataset`) and `PerReplica`
        values reach each replica as its own part; every other array (e.g.
        the replicated weights of a stateless train step) reaches every
        replica whole, as in tf.distribute. Pytrees are fine everywhere.
        Inside `fn`, `kd.get_replica_context()` gives the replica's id and
        the collectives `all_reduce` and `all_gather`.

        The function is compiled with `jax.shard_map` over the axis
        `"batch"` once per argument structure and shapes, then cached.

        Example:

        ```python
        def step(x):
            return (x * 2.0).sum()              # runs on each replica's rows
        per_replica = strategy.run(step, args=(batch,))
        total = strategy.reduce("sum", per_replica, axis=None)
        ```

        Args:
            fn: the per-replica function; must return arrays or pytrees of
                arrays.
            args: positional arguments of `fn`.
            kwargs: keyword arguments of `fn`. Defaults to `None`.

        Returns:
            `fn`'s outputs: a `PerReplica` for each output that differs
            between replicas, a replicated `jax.Array` for each output that
            is the same on every replica (e.g. after `all_reduce`).

        Raises:
            TypeError: if `fn` returns something that is not an array.
        """
        return _run.run(self, fn, args, kwargs, cache=self._run_cache)

    def reduce(
        self, reduce_op: "ReduceOp | str", value: Any, axis: int | None = None
    ) -> jax.Array:
        """Combines the replicas' values into one (outside `run`).

        Args:
            reduce_op: `"sum"` or `"mean"` (or `kd.ReduceOp.SUM/MEAN`).
            value: a `PerReplica`, a distributed batch, or an array (the same
                on every replica); pytrees of them too.
            axis: `None` to combine the replicas element-wise; an int to
                also reduce along that axis of each replica's value (e.g.
                `axis=0` over per-example values: padded rows of a partial
                batch are left out).

        Raises:
            ValueError: if `reduce_op` is not a known reduction.
        """
        return _cross_replica.reduce(self, reduce_op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' values along `axis` (outside `run`).

        Along axis 0 of per-example values, the padded rows of a partial
        batch are left out: the result has exactly the real rows.
        """
        return _cross_replica.gather(self, value, axis)

    def experimental_local_results(self, value: Any) -> tuple:
        """The values of this process's replicas, as a tuple (outside `run`)."""
        return _cross_replica.experimental_local_results(self, value)

    # Distributed input ------------------------------------------------------

    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> _distributed_dataset.DistributedDataset:
        """Splits each global batch of `dataset` over the replicas.

        Example:

        ```python
        GLOBAL_BATCH_SIZE = 64 * strategy.num_replicas_in_sync
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE)
        for images, labels in strategy.experimental_distribute_dataset(dataset):
            strategy.run(train_step, args=(state, images, labels))
        ```

        Args:
            dataset: a `tf.data.Dataset` (or any iterable of NumPy batches)
                batched by the global batch size.
            options: a `kd.InputOptions` (prefetch to device, buffer size).

        Returns:
            A `DistributedDataset`: each `iter()` is a new pass yielding the
            dataset's elements as global `jax.Array`s split over the replicas.
            A partial last batch is padded; `run`, `compute_average_loss`,
            `gather` and `reduce` leave the padding out.

        Raises:
            ValueError: if the dataset is not batched.
        """
        return _distributed_dataset.distribute_dataset(self.placement, dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable, options: InputOptions | None = None
    ) -> _distributed_dataset.DistributedDataset:
        """Builds the input from `dataset_fn(input_context)` per input pipeline.

        `dataset_fn` gets a `kd.InputContext` and returns a dataset batched by
        the *per-replica* batch size
        (`input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)`); one
        batch per replica forms each global batch.

        Raises:
            ValueError: if the returned dataset is not batched.
        """
        return _distributed_dataset.distribute_datasets_from_function(
            self.placement, dataset_fn, options
        )

    def __repr__(self) -> str:
        names = [device_name(d) for d in self.devices]
        if len(names) > 4:
            names = [*names[:2], "...", names[-1]]
        model = (
            f", model_parallel={self.model_parallel}" if self.model_parallel > 1 else ""
        )
        return (
            f"{type(self).__name__}(devices=[{', '.join(names)}], "
            f"num_replicas_in_sync={self.num_replicas_in_sync}{model})"
        )

    __str__ = __repr__


install_moved_methods(Strategy)


def _check_same_variable(variable: keras.Variable) -> None:
    mine = [variable.path, list(variable.shape), str(variable.dtype)]
    everyone = _sync.allgather("variable", mine)
    if all(other[1:] == mine[1:] for other in everyone):
        return
    found = "; ".join(
        f"process {p}: {path!r} of shape {tuple(shape)} and dtype {dtype}"
        for p, (path, shape, dtype) in enumerate(everyone)
    )
    raise ProcessMismatchError(
        f"The processes create different variables ({found}). With several "
        "processes every process must run the same program and build the same "
        "model in `strategy.scope()`."
    )
