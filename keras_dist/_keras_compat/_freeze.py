"""A model's state frozen without waiting for the step computing it.

`freeze(values)` copies device arrays on their devices in one compiled,
asynchronously dispatched program (the training thread does not wait for
the step that computes them, and the next step may donate the originals),
or to host memory when the devices lack room. A replicated value is copied
once per process, on its first device. The writers (Keras's files in
`_saving.py`, Orbax's in `callbacks/`) then read the copies on any thread.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

__all__ = ["freeze", "prepare"]


def _room_on_devices(values: list) -> bool:
    """Whether every device has room for a copy of its parts of `values`.

    Devices that report no memory statistics (CPU) are taken to have room.
    """
    limits: dict = {}
    for v in values:
        for device in _addressable_devices(v.sharding):
            if device not in limits:
                stats = (
                    device.memory_stats() if hasattr(device, "memory_stats") else None
                )
                limits[device] = (
                    stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                    if stats and "bytes_limit" in stats
                    else None
                )
    if all(free is None for free in limits.values()):
        return True
    need = dict.fromkeys(limits, 0)
    for v in values:
        part = _part_nbytes(v.sharding, v.shape, v.dtype)
        for device in _addressable_devices(v.sharding):
            need[device] += part
    return all(
        free is None or need[device] <= 0.9 * free for device, free in limits.items()
    )


@functools.lru_cache(maxsize=1024)
def _addressable_devices(sharding: jax.sharding.Sharding) -> tuple:
    return tuple(sharding.addressable_devices)


def _part_nbytes(sharding: jax.sharding.Sharding, shape: tuple, dtype: Any) -> int:
    """Bytes of one device's part of a value of `shape` laid out by `sharding`."""
    return math.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize


def _to_numpy(arrays: list) -> list:
    """Host copies (waiting for the values); parts on other processes gathered."""
    for a in arrays:
        if a.is_fully_addressable:
            a.copy_to_host_async()
    return [
        np.array(a, copy=True)
        if a.is_fully_addressable
        else np.asarray(multihost_utils.process_allgather(a, tiled=True))
        for a in arrays
    ]


def _in_device_memory(a: jax.Array) -> bool:
    return getattr(a.sharding, "memory_kind", None) in (None, "device")


def _first_devices(a: jax.Array) -> tuple:
    """Each process's first device (by id) among those holding `a`: the same
    list on every process."""
    return _first_devices_of(a.sharding)


@functools.lru_cache(maxsize=1024)
def _first_devices_of(sharding: jax.sharding.Sharding) -> tuple:
    devices: list[Any] = list(sharding.device_set)
    first: dict = {}
    for d in sorted(devices, key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return tuple(first[p] for p in sorted(first))


# A sharding -> the index, in a replicated value's addressable parts, of its
# part on this process's first device (JAX keeps parts in the sharding's
# device order): looked up once, not in each save's 8 x values parts.
_FIRST_REPLICA_INDEX: dict = {}


def _first_replica(a: jax.Array) -> jax.Array:
    """`a`'s replica on this process's first device (no copy, no wait)."""
    index = _FIRST_REPLICA_INDEX.get(a.sharding)
    if index is None:
        here = jax.process_index()
        device = next(d for d in _first_devices(a) if d.process_index == here)
        index = [s.device for s in a.addressable_shards].index(device)
        if len(_FIRST_REPLICA_INDEX) >= 1024:
            _FIRST_REPLICA_INDEX.clear()
        _FIRST_REPLICA_INDEX[a.sharding] = index
    if index == 0:
        return a.addressable_data(0)  # A replicated value's first part.
    return a.addressable_shards[index].data


def _replicated_on_first_devices(a: jax.Array, local: jax.Array) -> jax.Array:
    """A global array with `a`'s value: replicated on each process's first
    device (`local`, this process's copy). Orbax writes it from process 0
    alone, as it writes `a`; a restore lays it out as its target says."""
    devices = _first_devices(a)
    if len(devices) == 1:
        return local
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devices), ("processes",)),
        jax.sharding.PartitionSpec(),
    )
    return jax.make_array_from_single_device_arrays(a.shape, sharding, [local])


@jax.jit
def _copy(arrays: list) -> list:
    """New buffers with the values of `arrays`, laid out alike (a compiled
    program: dispatched without waiting for `arrays` to be computed).

    The zero added goes through an optimization barrier so that the adds
    stay adds: simplified to plain copies, the program costs no flops, and
    XLA:CPU runs a program estimated under 1000 flops inline, on the calling
    thread, whenever its inputs are ready (`cheap_computation_` in its PjRt
    client): the training thread then waited for the whole copy (56 ms of a
    96 MB replica in a save, against 0.1-0.4 ms to dispatch it)."""
    return [a + lax.optimization_barrier(jnp.zeros((), a.dtype)) for a in arrays]


def freeze(
    values: list, *, to_host_arrays: bool = False, copy_local: bool = True
) -> list:
    """`values` frozen without waiting for them to be computed.

    Device arrays are copied on their devices (one asynchronous dispatch of
    a compiled copy: the training thread does not wait for the step that
    computes them, and the next step may donate the originals) when the
    devices have room (values with parts on other processes always: every
    process must run the same copy), else copied to host now (which waits
    for that step). They stay global arrays (what Orbax writes, each
    process its parts): with several processes every process must freeze
    the same values in the same order. A value replicated on several
    devices is copied once per process, on its first device (a writer reads
    one replica): the frozen array is replicated on those devices.

    With `to_host_arrays` (for a writer that needs the whole value on this
    process), a value with parts on other processes is gathered to host now
    (a collective), and a replicated one is copied from this process's
    first device. Without `copy_local` (a process that only takes part in
    those gathers: it writes nothing), the values on this process are not
    copied.
    """
    values, out, replicated, groups = _plan(values, to_host_arrays, copy_local)
    if not copy_local:
        return out
    for copied, members in groups:
        group = [values[i] for i in members]
        copies = _copy(group) if copied else _to_numpy(group)
        for i, copy in zip(members, copies, strict=True):
            out[i] = copy
    if not to_host_arrays:  # Global arrays again (what Orbax writes).
        for i, v in replicated.items():
            if isinstance(out[i], jax.Array):
                out[i] = _replicated_on_first_devices(v, out[i])
    for i, v in enumerate(values):
        if not isinstance(v, jax.Array):
            out[i] = np.asarray(keras.ops.convert_to_numpy(v))
    return out


def _plan(values: list, to_host_arrays: bool, copy_local: bool) -> tuple:
    """`freeze`'s plan: the values to copy (a replicated value's first
    replica), the output so far (gathered values), the replicated values,
    and the groups to copy: `(copied on the devices, members)`."""
    values = [v.value if isinstance(v, keras.Variable) else v for v in values]
    out = list(values)
    # A replicated value is frozen once per process, not once per device:
    # its copy on this process's first device (a writer reads one replica).
    replicated: dict[int, jax.Array] = {}
    for i, v in enumerate(values):
        if not isinstance(v, jax.Array):
            continue
        if v.is_fully_replicated and len(v.sharding.device_set) > 1:
            if _in_device_memory(v):
                replicated[i] = v
                values[i] = _first_replica(v)
        elif to_host_arrays and not v.is_fully_addressable:
            out[i] = np.asarray(multihost_utils.process_allgather(v, tiled=True))
    arrays = [
        i
        for i, v in enumerate(values)
        if isinstance(v, jax.Array) and not isinstance(out[i], np.ndarray)
    ]
    if not copy_local:
        return values, out, replicated, []
    # One compiled copy per set of devices (a program runs on one set);
    # values kept in host memory (CentralStorageStrategy) go to NumPy.
    by_devices: dict = {}
    for i in arrays:
        on_device = _in_device_memory(values[i])
        key = (frozenset(d.id for d in values[i].sharding.device_set), on_device)
        by_devices.setdefault(key, []).append(i)
    groups = []
    for (_, on_device), members in by_devices.items():
        group = [values[i] for i in members]
        # Values spanning processes: every process must take the same road.
        # (A replicated value's copy is one of a global array's parts.)
        spans = not all(a.is_fully_addressable for a in group) or any(
            not replicated[i].is_fully_addressable
            for i in members
            if i in replicated and not to_host_arrays
        )
        copied = on_device and (spans or _room_on_devices(group))
        groups.append((copied, members))
    return values, out, replicated, groups


def prepare(values: list, *, to_host_arrays: bool = False) -> None:
    """Compiles the copies `freeze(values, to_host_arrays=...)` dispatches,
    copying nothing: when `fit` begins, so that the first save does not
    compile them on the training thread (1.5 s on 8 CPU devices for an MLP's
    56 arrays, 973 MB). Values with parts on other processes are left to
    the save (their gathers are collectives)."""
    if any(
        isinstance(v, jax.Array) and not v.is_fully_addressable
        for v in (x.value if isinstance(x, keras.Variable) else x for x in values)
    ):
        return
    values, _, _, groups = _plan(values, to_host_arrays, copy_local=True)
    for copied, members in groups:
        if copied:
            _copy.lower([values[i] for i in members]).compile()
