"""`StrategyParts`: what the replica API and the memory report read of a strategy.

The modules that implement `Strategy`'s replica API (`_run`, `_cross_replica`,
`_replica_context`, `_values`), its memory report and its registry are
imported by `_base.py`, so they cannot import `Strategy`. They take a
strategy as this declared protocol instead: public members only, each a
collaborator or a fact about the mesh.
"""

from typing import Protocol

import jax
import keras

from keras_dist.strategies.placement._placement import Pacer, Placement
from keras_dist.strategies.state._state_layout import StateLayout

__all__ = ["StrategyParts"]


class StrategyParts(Protocol):
    """A keras_dist strategy, as its own implementation modules see it."""

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The mesh (axes `("batch",)` or `("batch", "model")`)."""

    @property
    def device_mesh(self) -> keras.distribution.DeviceMesh:
        """The same mesh, as Keras describes it."""

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices of the mesh, in mesh order."""

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas a global batch is split over."""

    @property
    def model_parallel(self) -> int:
        """Devices per replica (the `"model"` axis; 1: a 1-D mesh)."""

    @property
    def spans_processes(self) -> bool:
        """Whether the mesh has devices of several processes."""

    @property
    def state_layout(self) -> StateLayout:
        """Where variables and optimizer state live."""

    @property
    def placement(self) -> Placement:
        """Where data goes."""

    @property
    def pacer(self) -> Pacer:
        """Programs in flight on CPU devices."""
