"""Test set-up: 8 virtual CPU devices and the JAX backend, before jax loads."""

import json
import os

from tests._xla import CODEGEN  # (imports no jax)

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
# XLA:CPU's loop emitters where JAX has them (tests/_xla.py says why).
if CODEGEN and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" {CODEGEN}"
os.environ["KERAS_BACKEND"] = "jax"
# jax starts below, before keras_dist is imported: give XLA:CPU's client the
# threads keras_dist's import would (3 a device; keras_dist/_backend.py).
os.environ.setdefault("PJRT_NPROC", "24")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # TF must not grab a GPU.
# Orbax's `gs://` paths through fsspec (gcsfs, which the tests point at a
# local fake-gcs-server: tests/_storage.py), not TensorFlow's gfile. Read
# once, at etils' first path: so here, before any test.
os.environ.setdefault("EPATH_USE_TF", "false")
# JAX's persistent compilation cache, shared by both xdist workers and every
# process a test starts (they inherit the environment): the suite builds the
# same small models under the same strategies in many files, and compiling is
# most of its time on 2 cores (tests/data/test_sparse.py: 77 s cold, 27 s
# with every program cached). A cached executable is the one XLA would build;
# the key holds the jax version, the program, its devices and options. No
# size cap: with one, JAX rescans the whole directory under a file lock at
# every write, which made a full run slower than no cache. An entry read
# while another process still writes it fails to load: JAX warns and
# compiles. It sits where pytest's `config.cache.mkdir` puts directories, so
# `pytest --cache-clear` empties it; JAX_COMPILATION_CACHE_DIR moves it.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, ".pytest_cache", "d", "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Python's cyclic collector, less often, here and in the processes the tests
# start (tests/_site/sitecustomize.py says why and how much).
if not os.environ.get("KD_TEST_GC_DEFAULTS"):
    import tests._site.sitecustomize  # noqa: F401 (sets the thresholds)

    _SITE = os.path.join(_ROOT, "tests", "_site")
    if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (_SITE, os.environ.get("PYTHONPATH")) if p
        )

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
    if config.getoption("one_case_each"):
        _keep_one_case_each(config, items)


def pytest_addoption(parser):
    parser.addoption(
        "--one-case-each",
        action="store_true",
        help="run one parametrization of each test function (CI's newest-stack "
        "stage: every test's code on the newest JAX and Keras, each strategy, "
        "model and input somewhere, not every combination again)",
    )


def _keep_one_case_each(config, items) -> None:
    """Keeps one case of each parametrized test: a different one for each
    test (by a hash of its name), so that across the suite every value of a
    shared parameter (a strategy, a layout) still runs."""
    import zlib

    cases: dict = {}
    for item in items:
        cases.setdefault(item.nodeid.split("[")[0], []).append(item)
    keep = set()
    for name, group in cases.items():
        keep.add(id(group[zlib.crc32(name.encode()) % len(group)]))
    dropped = [item for item in items if id(item) not in keep]
    items[:] = [item for item in items if id(item) in keep]
    config.hook.pytest_deselected(items=dropped)


# The CPU time each test used: its process's and that of the processes it
# started and waited for (a cluster's, a subprocess's), its phases summed. On
# 2 cores the suite is CPU-bound (CI prints its idle share): a test that
# waits costs little, one that computes costs the others' time. Printed
# above pytest's slowest durations, with xdist too (the workers send it in
# the reports).
def _cpu_seconds() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU time since the previous one's."""
    outcome = yield
    now = _cpu_seconds()
    began = item.stash.get(_CPU_AT, now)
    item.stash[_CPU_AT] = now
    outcome.get_result().user_properties.append(("cpu_s", now - began))


_CPU_AT = pytest.StashKey[float]()
_CPU_USED: dict = {}


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == "cpu_s":
            _CPU_USED[report.nodeid] = _CPU_USED.get(report.nodeid, 0.0) + value


def pytest_terminal_summary(terminalreporter):
    if not _CPU_USED:
        return
    if os.environ.get("KD_CPU_REPORT"):  # Every test's, as JSON: {nodeid: s}.
        with open(os.environ["KD_CPU_REPORT"], "w") as f:
            json.dump(_CPU_USED, f, indent=0, sort_keys=True)
    total = sum(_CPU_USED.values())
    terminalreporter.write_sep(
        "=", f"most CPU time: 25 of {len(_CPU_USED)} tests, {total:.0f} s in all"
    )
    ranked = sorted(_CPU_USED.items(), key=lambda kv: -kv[1])
    for nodeid, seconds in ranked[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
    by_file: dict = {}
    for nodeid, seconds in _CPU_USED.items():
        path = nodeid.split("::")[0]
        by_file[path] = by_file.get(path, 0.0) + seconds
    terminalreporter.write_sep("=", "most CPU time by file: 25")
    for path, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {path}")
