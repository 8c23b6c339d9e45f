"""Strategies: what the mesh is, where variables live, the replica API."""

from keras_dist.strategies._base import Strategy
from keras_dist.strategies._central_storage import CentralStorageStrategy
from keras_dist.strategies._mirrored import MirroredStrategy
from keras_dist.strategies._multi_worker import (
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from keras_dist.strategies._one_device import OneDeviceStrategy
from keras_dist.strategies._parameter_server import ParameterServerStrategy
from keras_dist.strategies.replica._replica_context import (
    ReplicaContext,
    get_replica_context,
)
from keras_dist.strategies.replica._values import PerReplica, ReduceOp
from keras_dist.strategies.state._memory_report import MemoryReport, VariableMemory

__all__ = [
    "CentralStorageStrategy",
    "CommunicationOptions",
    "MemoryReport",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "VariableMemory",
    "get_replica_context",
]
