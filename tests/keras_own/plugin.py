"""A pytest plugin: run Keras's own tests inside a keras_dist strategy's scope.

    KERAS=$(python -c 'import keras, os; print(os.path.dirname(keras.__file__))')
    python -m pytest -p tests.keras_own.plugin -o addopts= \
        --kd-strategy=mirrored "$KERAS/src/trainers/trainer_test.py"

Every test runs inside `strategy.scope()` of a fresh strategy over 8 virtual
CPU devices (`--kd-strategy`: `mirrored` or `central_storage`), as a user
who wraps their Keras script in a strategy would. A call under a strategy
must behave as the same call without one, so Keras's own assertions apply
unchanged.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


STRATEGIES = ("mirrored", "central_storage")


def pytest_addoption(parser):
    parser.addoption(
        "--kd-strategy",
        default="mirrored",
        choices=STRATEGIES,
        help="the keras_dist strategy whose scope every test runs in",
    )


def pytest_configure(config):
    """Enters a fresh strategy's scope at the end of each Keras test's setUp.

    Keras's `TestCase.setUp` clears the session, which also clears the
    current distribution: the scope is entered after it, and left at cleanup.
    """
    from keras.src import testing

    name = config.getoption("--kd-strategy")
    original = testing.TestCase.setUp

    def setUp(self):
        import keras_dist as kd

        original(self)
        strategy = (
            kd.MirroredStrategy() if name == "mirrored" else kd.CentralStorageStrategy()
        )
        scope = strategy.scope()
        scope.__enter__()
        self.addCleanup(scope.__exit__, None, None, None)

    testing.TestCase.setUp = setUp
