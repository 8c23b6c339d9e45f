"""At most a few programs in flight on CPU devices (XLA:CPU collective deadlock).

JAX dispatches a program and returns before it runs; the host can run ahead
of the devices. On CPU devices the XLA client admits at most 32 programs in
flight per device (a semaphore, taken when a device's part of a program is
launched, on a thread pool). When a fast step with a collective (the
gradients' all-reduce) fills it, a device's part of one step can wait for a
slot while the other devices wait for it in the all-reduce: XLA then aborts
the process ("Expected 8 threads to join the rendezvous, but only 7 of them
arrived"). It takes a few hundred steps of a small model, and a
hand-written `jax.jit` loop hits it as Keras's loops do; a few programs in
flight never do (the measurements: benchmarks/README.md, "Figures the
code's design rests on"). An eager step (`run_eagerly=True`) dispatches
many small programs and is paced as one: Keras's eager loop waits on its
own results.

`Pacer.after(outputs)` is called with each dispatched program's outputs; on
a strategy over more than one CPU device it then waits until the program
`DEPTH` dispatches earlier has finished. On GPUs and TPUs it does nothing.
Waiting for a program that finished long ago costs microseconds, and `DEPTH`
programs in flight are still far more than the host needs to stay ahead.
"""

import collections
from typing import Any

import jax

__all__ = ["DEPTH", "Pacer"]

DEPTH = 8


class Pacer:
    """Keeps at most `DEPTH` programs in flight, on CPU devices only.

    Args:
        devices: the devices the programs run on.
    """

    def __init__(self, devices):
        devices = list(devices)
        self.enabled = len(devices) > 1 and all(d.platform == "cpu" for d in devices)
        self._in_flight: collections.deque = collections.deque()

    def after(self, outputs: Any) -> None:
        """`outputs` were just dispatched; waits for the program `DEPTH` back."""
        if not self.enabled:
            return
        marker = _first_array(outputs)
        if marker is None:
            return
        self._in_flight.append(marker)
        if len(self._in_flight) > DEPTH:
            oldest = self._in_flight.popleft()
            if not oldest.is_deleted():
                oldest.block_until_ready()


def _first_array(outputs: Any) -> jax.Array | None:
    """The first concrete array of `outputs` (not a tracer: a traced call).

    Walks containers only until it finds one: a step's outputs begin with
    its logs, and its whole state need not be flattened every step.
    """
    if isinstance(outputs, jax.Array):
        return outputs if hasattr(outputs, "is_deleted") else None
    if isinstance(outputs, dict):
        outputs = outputs.values()
    elif not isinstance(outputs, (list, tuple)):
        # Another pytree (a dataclass, a registered class): its leaves. A
        # leaf that is not an array (None, a number, a tracer's) ends here.
        leaves = jax.tree.leaves(outputs)
        if leaves == [outputs]:
            return None
        outputs = leaves
    for item in outputs:
        found = _first_array(item)
        if found is not None:
            return found
    return None
