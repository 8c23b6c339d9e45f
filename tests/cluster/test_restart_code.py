"""Which uncaught errors make a keras_dist process exit with
`kd.cluster.RESTART_EXIT_CODE` (75: it lost a peer) rather than 1 (its own
error). The real exit of a survivor: `test_faults.py`."""

import pytest

import keras_dist as kd
from keras_dist.cluster._initialize import lost_a_peer

GLOO = (
    "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/"
    "pair.cc:547] Connection closed by peer [127.0.0.1]:19229"
)


@pytest.mark.parametrize(
    "error",
    [
        ValueError(GLOO),  # As jax raises it from `float(array)`.
        RuntimeError("UNAVAILABLE: The coordination service has stopped."),
        kd.errors.ClusterTimeoutError("process 1 did not reach the barrier"),
    ],
    ids=["gloo", "coordination", "cluster-timeout"],
)
def test_a_lost_peer_is_told_apart(error):
    assert lost_a_peer(error)
    try:  # Raised from it: still the lost peer.
        raise KeyError("in a callback") from error
    except KeyError as chained:
        assert lost_a_peer(chained)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("a bad batch at step 11"),
        ValueError("my gloo setting is wrong"),  # No XLA status: the user's.
        RuntimeError("INTERNAL: ptxas exited with a non-zero status"),
        MemoryError(),
    ],
)
def test_the_programs_own_errors_are_not(error):
    assert not lost_a_peer(error)
