"""The strategies the tests compare, by name; each call builds a new one.

Every strategy runs on the 8 virtual CPU devices (one device for
`one_device`); the split-state ones split over all 8.
"""

import keras_dist as kd
from tests._helpers import mirrored

EIGHT = [f"cpu:{i}" for i in range(8)]
STRATEGIES = {
    "one_device": lambda: kd.OneDeviceStrategy("cpu:0"),
    "mirrored": lambda: mirrored(8),
    "parameter_server": lambda: kd.ParameterServerStrategy(
        variable_partitioner=kd.partitioners.FixedShardsPartitioner(8)
    ),
    "fsdp": lambda: kd.MirroredStrategy(EIGHT, shard_variables=True),
    "zero1": lambda: kd.MirroredStrategy(EIGHT, shard_optimizer_state=True),
    "central_storage": lambda: kd.CentralStorageStrategy(),
}
# Variables (PS, FSDP) or optimizer slots (ZeRO-1) split over the devices.
SPLIT_STATE = ("parameter_server", "fsdp", "zero1")


def pick(*names: str) -> dict:
    """The factories of `names`, in that order."""
    return {name: STRATEGIES[name] for name in names}
