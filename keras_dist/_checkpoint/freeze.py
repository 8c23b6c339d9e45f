"""A snapshot on the devices: the values to save, frozen without a wait.

`freeze` (on the training thread) copies the values on their devices with
one compiled program, dispatched without waiting for the step computing
them (the next step may donate the originals), or to host memory where
the devices lack room. A replicated value is copied once; a value with
parts on other processes is gathered (a collective). Both engines take
their snapshots here (`keras_files.py`; `orbax_store.py` with one
process: with several, Orbax's asynchronous save takes its own).
"""

import functools
import math

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

__all__ = ["freeze", "prepare"]


@functools.lru_cache(maxsize=1024)
def _addressable_devices(sharding: jax.sharding.Sharding) -> tuple:
    return tuple(sharding.addressable_devices)


def _room_on_devices(values: list) -> bool:
    """Whether every device has room for a copy of its parts of `values`
    (devices that report no memory statistics, CPU's, are taken to)."""
    need: dict = {}
    for v in values:
        part = math.prod(v.sharding.shard_shape(v.shape)) * np.dtype(v.dtype).itemsize
        for device in _addressable_devices(v.sharding):
            need[device] = need.get(device, 0) + part
    for device, nbytes in need.items():
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            continue
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if nbytes > 0.9 * free:
            return False
    return True


# A sharding -> the index, among a replicated value's addressable parts, of
# its part on this process's first device: looked up once per sharding.
_FIRST_REPLICA: dict = {}


def _first_replica(a: jax.Array) -> jax.Array:
    """`a`'s replica on this process's first device (no copy, no wait)."""
    index = _FIRST_REPLICA.get(a.sharding)
    if index is None:
        first = min(_addressable_devices(a.sharding), key=lambda d: d.id)
        index = [s.device for s in a.addressable_shards].index(first)
        if len(_FIRST_REPLICA) >= 1024:
            _FIRST_REPLICA.clear()
        _FIRST_REPLICA[a.sharding] = index
    return a.addressable_data(0) if index == 0 else a.addressable_shards[index].data


@jax.jit
def _copy(arrays: list) -> list:
    """New buffers with the values of `arrays`, laid out alike (a compiled
    program: dispatched without waiting for `arrays` to be computed).

    The zero added goes through an optimization barrier so that the adds
    stay adds: XLA:CPU runs a program estimated under 1000 flops inline, on
    the calling thread, once its inputs are ready; plain copies count 0
    flops, and the training thread then waited for the whole copy."""
    return [a + lax.optimization_barrier(jnp.zeros((), a.dtype)) for a in arrays]


def _plan(values: list) -> tuple[list, list, list]:
    """`freeze`'s plan: the values to copy (a replicated value's first
    replica; a value split over processes gathered to NumPy now), and the
    groups `(copied on the devices, members)`: one compiled copy per set of
    devices; values kept in host memory go to NumPy."""
    values = [v.value if isinstance(v, keras.Variable) else v for v in values]
    out = list(values)
    by_devices: dict = {}
    for i, v in enumerate(values):
        if not isinstance(v, jax.Array):
            continue
        if not v.is_fully_addressable:
            out[i] = np.asarray(multihost_utils.process_allgather(v, tiled=True))
            continue
        if v.is_fully_replicated and len(v.sharding.device_set) > 1:
            values[i] = v = _first_replica(v)
        on_device = getattr(v.sharding, "memory_kind", None) in (None, "device")
        key = (frozenset(d.id for d in v.sharding.device_set), on_device)  # type: ignore[attr-defined]
        by_devices.setdefault(key, []).append(i)
    groups = [
        (on_device and _room_on_devices([values[i] for i in members]), members)
        for (_, on_device), members in by_devices.items()
    ]
    return values, out, groups


def freeze(values: list, *, copy_local: bool = True) -> list:
    """`values` (variables or arrays) frozen without waiting for them: device
    copies, or host arrays. Values split over processes are gathered (every
    process must call this with the same values in the same order);
    `copy_local=False` (a process that writes nothing) only takes part in
    those gathers."""
    values, out, groups = _plan(values)
    if not copy_local:
        return out
    for on_device, members in groups:
        group = [values[i] for i in members]
        if on_device:
            copies = _copy(group)
        else:
            for a in group:
                a.copy_to_host_async()
            copies = [np.array(a, copy=True) for a in group]
        for i, copy in zip(members, copies, strict=True):
            out[i] = copy
    return [v if isinstance(v, (jax.Array, np.ndarray)) else np.asarray(v) for v in out]


def prepare(values: list) -> None:
    """Compiles the copies `freeze(values)` dispatches, copying nothing: when
    `fit` begins, not on the training thread at the first save (a
    compilation for each layout and size). Values with parts on other
    processes are left to the save (their gathers are collectives)."""
    plain = [v.value if isinstance(v, keras.Variable) else v for v in values]
    if any(isinstance(v, jax.Array) and not v.is_fully_addressable for v in plain):
        return
    values, _, groups = _plan(plain)
    for on_device, members in groups:
        if on_device:
            _copy.lower([values[i] for i in members]).compile()
