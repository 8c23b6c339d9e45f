"""A pytest plugin: run Keras's own tests inside a keras_dist strategy's scope.

    KERAS=$(python -c 'import keras, os; print(os.path.dirname(keras.__file__))')
    python -m pytest -p tests.keras_own.plugin -o addopts= \
        --kd-strategy=mirrored "$KERAS/src/trainers/trainer_test.py"

Every test runs inside `strategy.scope()` of a fresh strategy (`--kd-strategy`:
`mirrored` or `central_storage` over 8 virtual CPU devices; `none`, plain
Keras, for comparison), as a user who wraps their Keras script in a strategy
would. A call under a strategy must behave as the same call without one, so
Keras's own assertions apply unchanged.

Across processes (`multi_worker`: `kd.MultiWorkerMirroredStrategy()`), the
same file runs in every process of a cluster the launcher starts:

    keras-dist-run -n 2 --devices-per-process 4 -m pytest \
        -p tests.keras_own.plugin -p no:randomly -o addopts= \
        --kd-strategy=multi_worker --kd-shared-tmp=/shared/dir FILE

and the processes run it as one job's processes run one program: every test
starts from the same seeds (NumPy's, Python's, Keras's: from the test's id),
`self.get_temp_dir()` is the same folder on every process (under
`--kd-shared-tmp`, as a job's processes are all handed one path), and after
each test the processes wait for each other (a bounded wait,
`--kd-test-timeout`) and agree on keras_dist's exchange counters, so a test
that failed on one process only does not leave the next ones out of step.
`--kd-results FILE` (`{process}` in it: the process index) writes every
collected test and its outcome as JSON, for `tests/test_keras_own.py` to
compare with plain Keras.
"""

import json
import os
import re
import shutil
import zlib

os.environ.setdefault("KERAS_BACKEND", "jax")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # (Under the launcher, `--devices-per-process` has set it.)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import pytest

STRATEGIES = ("mirrored", "central_storage", "multi_worker", "none")
_STATE: dict = {"outcomes": {}, "collected": [], "temp_dirs": 0}


def pytest_addoption(parser):
    group = parser.getgroup("keras_dist")
    group.addoption(
        "--kd-strategy",
        default="mirrored",
        choices=STRATEGIES,
        help="the keras_dist strategy whose scope every test runs in "
        "(none: plain Keras)",
    )
    group.addoption(
        "--kd-results",
        default=None,
        help="write the collected tests and their outcomes to this JSON file "
        "({process}: this process's index)",
    )
    group.addoption(
        "--kd-shared-tmp",
        default=None,
        help="the folder every process shares: get_temp_dir() is made in it, "
        "the same path on every process",
    )
    group.addoption(
        "--kd-test-timeout",
        type=float,
        default=180.0,
        help="seconds a process waits for the others at the end of a test",
    )


def _seed(nodeid: str) -> int:
    return zlib.crc32(nodeid.encode()) % (2**31)


def pytest_configure(config):
    """Enters a fresh strategy's scope at the end of each Keras test's setUp.

    Keras's `TestCase.setUp` clears the session, which also clears the
    current distribution and Keras's seed: the scope is entered after it,
    then the test's seeds are set, and the scope is left at cleanup.
    """
    from keras.src import testing

    name = config.getoption("--kd-strategy")
    shared = config.getoption("--kd-shared-tmp")
    _STATE["shared"], _STATE["strategy"] = shared, name
    if name == "multi_worker":
        import keras_dist as kd

        kd.MultiWorkerMirroredStrategy()  # Joins the cluster, once.
    original_setup = testing.TestCase.setUp

    def setUp(self):
        import keras

        import keras_dist as kd

        original_setup(self)
        strategy = {
            "mirrored": kd.MirroredStrategy,
            "central_storage": kd.CentralStorageStrategy,
            "multi_worker": kd.MultiWorkerMirroredStrategy,
            "none": None,
        }[name]
        if strategy is not None:
            scope = strategy().scope()
            scope.__enter__()
            self.addCleanup(scope.__exit__, None, None, None)
        keras.utils.set_random_seed(_seed(self.id()))

    testing.TestCase.setUp = setUp
    from keras.src.testing import test_utils

    get_test_data = test_utils.get_test_data

    def seeded_get_test_data(*args, random_seed=None, **kwargs):
        """Keras's, from the test's seed when given none (Keras's reseeds
        NumPy from the OS then: each process would make other data)."""
        if random_seed is None:
            random_seed = _seed(_STATE.get("current", ""))
        return get_test_data(*args, random_seed=random_seed, **kwargs)

    test_utils.get_test_data = seeded_get_test_data
    config.addinivalue_line(
        "markers", "requires_trainable_backend: Keras's (its conftest.py's)"
    )
    if shared:

        def get_temp_dir(self):
            """The same new folder on every process (removed after the test,
            once every process has ended it)."""
            _STATE["temp_dirs"] += 1
            test = _test_dir(_STATE["current"])
            path = os.path.join(shared, test, str(_STATE["temp_dirs"]))
            os.makedirs(path, exist_ok=True)
            return path

        testing.TestCase.get_temp_dir = get_temp_dir


def _test_dir(test_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id)[-120:]


def pytest_collection_finish(session):
    """The tests this process runs (after `-k` and `-m` deselected some)."""
    _STATE["collected"] = [item.nodeid for item in session.items]


def pytest_runtest_setup(item):
    """The same seeds on every process (tests outside a TestCase too)."""
    import keras

    _STATE["temp_dirs"], _STATE["current"] = 0, item.nodeid
    keras.utils.set_random_seed(_seed(item.nodeid))


def pytest_runtest_logreport(report):
    outcomes = _STATE["outcomes"]
    if (
        report.failed or report.outcome == "skipped" or report.when == "call"
    ) and outcomes.get(report.nodeid) not in ("failed", "skipped"):
        outcomes[report.nodeid] = report.outcome


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Every process ends the test before any begins the next one."""
    import jax

    from keras_dist.cluster import _sync

    if not _sync.multi_process():
        return
    ended = _end_together(item.nodeid, item.config.getoption("--kd-test-timeout"))
    names = {nodeid for nodeid, _ in ended}
    if len(names) != 1:
        raise RuntimeError(f"The processes ended different tests: {sorted(names)}")
    # A test that failed on one process before an exchange the others made
    # left their counters ahead: all go on from the highest.
    for _, counters in ended:
        for key, count in counters.items():
            _sync._COUNTERS[key] = max(_sync._COUNTERS.get(key, 0), count)
    shared = _STATE.get("shared")
    if shared and jax.process_index() == 0:
        shutil.rmtree(os.path.join(shared, _test_dir(item.nodeid)), True)


def _end_together(nodeid: str, timeout: float) -> list:
    """Waits (up to `timeout` s) until every process has ended the test;
    each one's test id and exchange counters.

    Unlike keras_dist's exchanges, it waits for a process that is elsewhere
    (still in the test): that process, waiting in an exchange this one left
    (the test failed here first), reads where this one is and fails at once
    (`ProcessMismatchError`), then comes here.
    """
    import jax

    from keras_dist.cluster import _sync

    client = _sync._client()
    me = jax.process_index()
    step = _sync._COUNTERS["keras_own/test-end"] = (
        _sync._COUNTERS.get("keras_own/test-end", 0) + 1
    )
    counters = dict(_sync._COUNTERS)
    client.key_value_set(f"keras_own/end/{step}/{me}", json.dumps([nodeid, counters]))
    client.key_value_set(f"keras_dist/at/{me}", f"keras_own/test-end/{step}")
    try:
        ended = [
            json.loads(
                client.blocking_key_value_get(
                    f"keras_own/end/{step}/{process}", int(timeout * 1000)
                )
            )
            for process in range(jax.process_count())
        ]
    finally:
        client.key_value_delete(f"keras_dist/at/{me}")
    if step > 1:  # Every process has read it (each wrote this one after).
        client.key_value_delete(f"keras_own/end/{step - 1}/{me}")
    return ended


def pytest_sessionfinish(session):
    path = session.config.getoption("--kd-results")
    if not path:
        return
    import jax

    process = jax.process_index() if _STATE["strategy"] == "multi_worker" else 0
    path = path.replace("{process}", str(process))
    with open(path + ".tmp", "w") as f:
        json.dump({"collected": _STATE["collected"], "outcomes": _STATE["outcomes"]}, f)
    os.replace(path + ".tmp", path)
    from keras_dist.cluster import _sync

    if _sync.multi_process():  # Every one's written before any exits (the
        # launcher stops the others when one exits with failed tests).
        _end_together("(session end)", session.config.getoption("--kd-test-timeout"))
