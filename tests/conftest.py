"""Test set-up: 8 virtual CPU devices and the JAX backend, before jax loads."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # TF must not grab a GPU.

import jax  # noqa: E402
import keras  # noqa: E402
import pytest  # noqa: E402

if jax.device_count() < 8:
    raise RuntimeError(
        "The tests need 8 virtual CPU devices, but jax sees "
        f"{jax.device_count()}: jax was initialised before tests/conftest.py "
        "could set XLA_FLAGS. Run the tests with `python -m pytest`."
    )

REPLICA_COUNTS = (2, 4, 8)


@pytest.fixture(autouse=True)
def _no_leaked_distribution():
    """Every test starts and ends with no global distribution."""
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first, each file's tests in their own order.

    xdist hands each worker whole files (`--dist loadfile`) in this order
    (`--no-loadscope-reorder`; by default it puts the files with the most
    tests first, which left the few-test multi-process files to the end,
    one worker running them while the other had finished).
    """
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # Stable.
