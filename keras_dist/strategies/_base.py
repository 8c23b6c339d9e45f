"""`Strategy`: a Keras 3 distribution that speaks tf.distribute."""

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist import _keras_compat
from keras_dist.data._partial_batch import pad_batch
from keras_dist.errors import StrategyMismatchError
from keras_dist.strategies._devices import device_name

__all__ = ["Strategy", "strategy_of_variable"]

BATCH_AXIS = "batch"

# DeviceMesh -> Strategy, so a variable's layout leads back to its strategy.
_STRATEGY_OF_MESH: "weakref.WeakKeyDictionary[Any, Strategy]" = (
    weakref.WeakKeyDictionary()
)


class Strategy(keras.distribution.DataParallel):
    """Base class of keras_dist strategies: a data-parallel Keras distribution.

    A strategy owns a 1-D `jax.sharding.Mesh` with the axis `"batch"`. Inside
    `strategy.scope()` every Keras variable is created replicated on the mesh
    and `model.fit/evaluate/predict` split each global batch over it. A model
    built in the scope remembers its strategy: calling `fit` outside the scope
    (as the tf.distribute tutorials do) still runs distributed.

    Use a concrete subclass: `MirroredStrategy` or `OneDeviceStrategy`.

    Args:
        devices: the resolved `jax.Device`s of the replicas, in mesh order.
    """

    def __init__(self, devices: Sequence[jax.Device]):
        _keras_compat.install()
        super().__init__(devices=list(devices))
        _STRATEGY_OF_MESH[self.device_mesh] = self

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas the global batch is split over."""
        return int(self.device_mesh.devices.size)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The `jax.Device`s of the replicas, in mesh order."""
        return tuple(self.device_mesh.devices.flat)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The 1-D `jax.sharding.Mesh` (axis `"batch"`) of this strategy."""
        return self.device_mesh.backend_mesh

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
        with super().scope():
            yield self

    def _data_sharding(self, ndim: int) -> NamedSharding:
        spec = (
            PartitionSpec(BATCH_AXIS, *([None] * (ndim - 1)))
            if ndim
            else PartitionSpec()
        )
        return NamedSharding(self.mesh, spec)

    def _distribute_batch(self, data: Any) -> Any:
        """Pads a host batch to a multiple of the replicas and shards it.

        Returns the batch as global `jax.Array`s split along the first axis
        over the mesh, wrapped in a `PaddedBatch` when padding was needed.
        """
        local_replicas = sum(
            d.process_index == jax.process_index() for d in self.devices
        )
        data = pad_batch(data, local_replicas)

        def shard(leaf):
            if leaf is None:
                return None
            if not isinstance(leaf, jax.Array):
                leaf = np.asarray(leaf)
            return jax.make_array_from_process_local_data(
                self._data_sharding(leaf.ndim), leaf
            )

        return jax.tree.map(shard, data)

    def __repr__(self) -> str:
        names = [device_name(d) for d in self.devices]
        if len(names) > 4:
            names = [*names[:2], "...", names[-1]]
        return (
            f"{type(self).__name__}(devices=[{', '.join(names)}], "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )

    __str__ = __repr__


def strategy_of_variable(variable) -> "Strategy | None":
    """The keras_dist strategy a Keras variable was created under, if any."""
    layout = getattr(variable, "_layout", None)
    mesh = getattr(layout, "device_mesh", None)
    if mesh is None:
        return None
    return _STRATEGY_OF_MESH.get(mesh)
