"""Programs in flight on CPU devices are bounded (`strategies/devices/_placement.py`).

XLA:CPU admits 32 programs in flight per device; when fast steps with an
all-reduce fill that, it can deadlock and abort the process after 40 s. On
this project's 2-core box, one epoch of 400 steps of a Flatten -> Dense
model on 8 CPU devices (`pacing_script.py`) aborted 2 of 2 times with the
pacer off (`unpaced`) and finished 4 of 4 times (7-8 s) with it on; the
run here is the paced one, in its own process (an abort ends the process).
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
from jax.sharding import NamedSharding, PartitionSpec

import keras_dist as kd
from keras_dist.strategies.devices._placement import DEPTH, Pacer

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


def test_a_long_epoch_on_eight_cpu_devices_completes():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "400"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DONE" in result.stdout
