"""Programs in flight on CPU devices (`strategies/placement/_placement.py`).

XLA:CPU launches a program of several devices as one task per device on its
client's thread pool, and a launch waits there while its device has 32
programs in flight; with max(cores, devices) threads, a flood of programs
can take the threads an all-reduce needs, and XLA aborts the process after
40 s. On this project's 2-core box, one epoch of 400 steps of a Flatten ->
Dense model on 8 CPU devices (`pacing_script.py`) with the pacer off
(`unpaced`) aborted 3 of 3 times with the old pool of 8 threads and finished
2 of 2 times with the 24 that `import keras_dist` now gives it
(`keras_dist/_backend.size_cpu_thread_pool`). Each run here is in its own
process (an abort ends the process).
"""

import dataclasses
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import keras_dist as kd
from keras_dist import _backend
from keras_dist.strategies.placement._placement import DEPTH, Pacer

SCRIPT = pathlib.Path(__file__).with_name("pacing_script.py")


def test_only_several_cpu_devices_are_paced():
    assert Pacer(jax.devices()).enabled
    assert not Pacer(jax.devices()[:1]).enabled
    tpus = [types.SimpleNamespace(platform="tpu") for _ in range(8)]
    assert not Pacer(tpus).enabled
    assert kd.MirroredStrategy().pacer.enabled
    assert not kd.OneDeviceStrategy("cpu:0").pacer.enabled


def test_at_most_depth_programs_are_in_flight():
    strategy = kd.MirroredStrategy()
    replicated = NamedSharding(strategy.mesh, PartitionSpec())
    rows = NamedSharding(strategy.mesh, PartitionSpec("batch"))

    @jax.jit
    def step(w, x):  # An all-reduce a step, as a data-parallel step has.
        grad = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return jnp.sum(grad), w - 0.01 * grad

    w = jax.device_put(jnp.ones((64, 64)), replicated)
    x = jax.device_put(np.random.RandomState(0).rand(256, 64), rows)
    pacer, markers = Pacer(strategy.devices), []
    for _ in range(3 * DEPTH):
        loss, w = step(w, x)
        pacer.after((loss, w))
        markers.append(loss)
        # Every program DEPTH dispatches back has finished.
        assert all(m.is_ready() for m in markers[:-DEPTH])
    assert len(pacer._in_flight) == DEPTH


def test_reduce_and_gather_are_paced_as_run_is():
    """A custom loop's `reduce` and `gather` each step are collectives too."""
    strategy = kd.MirroredStrategy()
    batch = strategy.placement.lay_out(np.arange(16.0, dtype="float32"))
    doubled = strategy.run(lambda v: v * 2, args=(batch,))
    in_flight = strategy.pacer._in_flight
    assert in_flight[-1] is doubled.stacked  # Per-replica outputs only: paced.
    total = strategy.reduce("sum", doubled, axis=0)
    assert in_flight[-1] is total and float(total) == 240.0
    gathered = strategy.gather(doubled, axis=0)
    assert in_flight[-1] is gathered
    np.testing.assert_array_equal(gathered, np.arange(16.0) * 2)


def test_deleted_and_traced_outputs_are_skipped():
    pacer = Pacer(jax.devices())
    donated = jax.device_put(jnp.ones(3))
    pacer.after(donated)
    donated.delete()
    for _ in range(DEPTH):
        pacer.after(jnp.ones(3))  # Pops the deleted one: no error.
    jax.jit(lambda v: pacer.after(v) or v)(jnp.ones(3))  # A tracer: skipped.
    assert len(pacer._in_flight) == DEPTH


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Outputs:  # A custom pytree, as a `strategy.run` function may return.
    loss: jax.Array
    extra: dict


def test_custom_pytree_outputs_are_paced():
    pacer = Pacer(jax.devices())
    outputs = [_Outputs(jnp.ones(()) * i, {"n": jnp.ones(2)}) for i in range(3)]
    for out in outputs:
        pacer.after(out)
    assert list(pacer._in_flight) == [out.loss for out in outputs]
    pacer.after(_Outputs(None, {}))  # No array at all: nothing to wait for.
    pacer.after(object())
    assert len(pacer._in_flight) == 3


def _child_env() -> dict:
    """This environment without the test set-up's XLA and thread settings."""
    dropped = {"XLA_FLAGS", "PJRT_NPROC", "NPROC"}
    return {k: v for k, v in os.environ.items() if k not in dropped}


@pytest.mark.slow  # Two 400-step epochs, each in a process of its own.
@pytest.mark.parametrize("paced", [True, False], ids=["paced", "unpaced"])
def test_a_long_epoch_on_eight_cpu_devices_completes(paced):
    """Unpaced, only the thread pool `import keras_dist` sizes keeps it alive."""
    args = [sys.executable, str(SCRIPT), "400"] + ([] if paced else ["unpaced"])
    result = subprocess.run(
        args, env=_child_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DONE" in result.stdout
    assert _sized(24) in result.stdout  # What the import set.


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**_child_env(), **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


_REPORT = "import os; print('PJRT_NPROC=' + str(os.environ.get('PJRT_NPROC')))"
_EIGHT = "--xla_force_host_platform_device_count=8"
_CORES = _backend.available_cores()


def _sized(threads: int) -> str:
    """What the import sets for `threads` wanted on this machine's cores."""
    return f"PJRT_NPROC={threads if threads > _CORES else None}"


def test_import_sizes_the_cpu_thread_pool_before_jax_starts():
    sized = _python(f"import keras_dist; {_REPORT}", XLA_FLAGS=_EIGHT)
    assert _sized(24) in sized.stdout, sized.stderr[-2000:]
    # The user's own value is kept; one device needs nothing.
    kept = _python(f"import keras_dist; {_REPORT}", XLA_FLAGS=_EIGHT, PJRT_NPROC="9")
    assert "PJRT_NPROC=9" in kept.stdout, kept.stderr[-2000:]
    one = _python(f"import keras_dist; {_REPORT}")
    assert "PJRT_NPROC=None" in one.stdout, one.stderr[-2000:]
    # jax_num_cpu_devices, set after the import: read by cluster.initialize's
    # sizing too (the same function), before JAX starts.
    late = _python(
        "import jax, keras_dist; from keras_dist import _backend; "
        "jax.config.update('jax_num_cpu_devices', 4); "
        f"_backend.size_cpu_thread_pool(); {_REPORT}"
    )
    assert _sized(12) in late.stdout, late.stderr[-2000:]


def test_jax_started_with_too_few_threads_warns_with_the_fix():
    started_first = _python(
        "import warnings; warnings.simplefilter('always'); "
        "import jax; jax.devices(); import keras_dist as kd; "
        "kd.MirroredStrategy(); kd.MirroredStrategy()",
        XLA_FLAGS=_EIGHT,
        NPROC="8",  # As on a machine with 8 cores or fewer (XLA reads it).
    )
    assert started_first.returncode == 0, started_first.stderr[-2000:]
    warning = started_first.stderr
    assert warning.count("RuntimeWarning") == 1  # Once.
    assert "for 8 CPU devices" in warning
    assert "set PJRT_NPROC=24 in the environment" in warning
