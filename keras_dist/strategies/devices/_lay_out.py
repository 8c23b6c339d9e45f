"""`lay_out`: a value laid out with a sharding, well-formed across processes.

Every array keras_dist lays out on a strategy's devices goes through here:
variables (through the seam on Keras's `distribute_tensor`), assigned
values, replicated values and batches.

**A JAX bug with one device per process.** `jax.device_put(x, sharding)`
of an array `x` that lives in this process (one device, e.g. a fresh
`jnp.ones`) to a sharding over several processes that is replicated where
this process holds it returns, when this process has exactly one device of
the sharding, an array whose one local piece claims every device of the
sharding: its `addressable_shards` raise ("the input arrays must have one
shard each. An argument array had 2 shard(s)"), and so does anything that
reads them (saving, `get_weights`, a checksum). With two or more local
devices, or from a NumPy array, the result is well-formed. JAX takes the
replicated target for the same layout as the source's and copies the
buffer with the target's sharding. Seen on JAX 0.10.2 and 0.12.0.1;
`tests/strategies/test_lay_out.py` records whether the installed JAX still
has it (a strict expected failure).

`lay_out` builds such an array from its pieces instead: each local device's
slice, put on that device, joined with
`jax.make_array_from_single_device_arrays` — no host round trip, no
collective (`jax.device_put` of a value living in one process compares it
across the processes first). Within one process, or for a value already
laid out over several processes, it is `jax.device_put`.
"""

from typing import Any

import jax

__all__ = ["lay_out", "needs_pieces"]


def lay_out(value: Any, sharding: jax.sharding.Sharding) -> Any:
    """`value` laid out as `sharding` (`jax.device_put`, well-formed).

    Args:
        value: a NumPy array, a Python number, or a `jax.Array`.
        sharding: where it goes (any `jax.sharding.Sharding`).
    """
    if needs_pieces(value, sharding):
        return _from_pieces(value, sharding)
    return jax.device_put(value, sharding)


def needs_pieces(value: Any, sharding: Any) -> bool:
    """Whether `value` is a concrete array of this process bound for a
    sharding that spans other processes too."""
    return (
        isinstance(value, jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and isinstance(sharding, jax.sharding.Sharding)
        and not sharding.is_fully_addressable
        and value.is_fully_addressable
    )


def _from_pieces(value: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    memory_kind = getattr(sharding, "memory_kind", None)
    shape = tuple(value.shape)
    pieces = [
        jax.device_put(
            value if _whole(index, shape) else value[index],
            jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind),
        )
        for device, index in sharding.addressable_devices_indices_map(shape).items()
    ]
    return jax.make_array_from_single_device_arrays(
        shape, sharding, pieces, dtype=value.dtype
    )


def _whole(index: Any, shape: tuple) -> bool:
    """Whether the slices of `index` take all of every dimension."""
    return index is not None and all(
        isinstance(part, slice) and part.indices(size) == (0, size, 1)
        for part, size in zip(index, shape, strict=False)
    )
