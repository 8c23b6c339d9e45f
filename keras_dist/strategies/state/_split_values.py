"""Values of split variables, made or placed part by part on their devices.

A variable the strategy splits (`ShardPlan`) should never exist whole on one
device: for a model that outgrows a device that copy alone does not fit, and
even when it fits it is one device computing everything, then a
device-to-device scatter. Here each device computes (`compute_split`) or
receives from the host (`fill_split`, `put_split`) only its own part.
"""

from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["compute_split", "fill_split", "put_split", "split_sharding"]

# (cache_key, sharding) -> the compiled function of the first `fn` given.
_COMPILED: dict = {}
_MAX_COMPILED = 512


def split_sharding(layout) -> jax.sharding.Sharding | None:
    """The sharding of a Keras `TensorLayout` that splits its variable, or None.

    None for no layout and for a layout that keeps the variable whole on
    every device (replicated).
    """
    sharding = getattr(layout, "backend_layout", layout)
    if not isinstance(sharding, jax.sharding.Sharding):
        return None
    if sharding.is_fully_replicated:
        return None
    return sharding


def compute_split(
    fn: Callable,
    args: Sequence[np.ndarray],
    sharding: NamedSharding,
    *,
    cache_key: Hashable | None = None,
) -> jax.Array:
    """`fn(*args)` compiled with `out_shardings=sharding`: each device computes
    only its part.

    Args:
        fn: a traceable function of `args` returning one array.
        args: small host arrays (e.g. a seed), sent whole to every device.
        sharding: the layout of the result.
        cache_key: when given, the compiled function is kept under this key
            (and `sharding`) and reused: the caller promises that every `fn`
            given with this key computes the same function of `args`.
            Defaults to `None`: compiled for this call only.
    """
    jitted: Callable[..., jax.Array] | None
    if cache_key is None:
        jitted = jax.jit(fn, out_shardings=sharding)
    else:
        jitted = _COMPILED.get((cache_key, sharding))
        if jitted is None:
            if len(_COMPILED) >= _MAX_COMPILED:
                _COMPILED.clear()
            jitted = _COMPILED[cache_key, sharding] = jax.jit(
                fn, out_shardings=sharding
            )
    whole = NamedSharding(sharding.mesh, PartitionSpec())
    return jitted(*(jax.device_put(np.asarray(a), whole) for a in args))


def put_split(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array laid out by `sharding`: each device receives its part."""
    return jax.device_put(value, sharding)


def fill_split(
    fill_value, shape: Sequence[int], dtype, sharding: jax.sharding.Sharding
) -> jax.Array:
    """An array of `fill_value` laid out by `sharding`, no compilation: each
    device receives its part, made on the host at the part's size."""
    dtype = jax.numpy.dtype(dtype)

    def part(index):
        return np.full(_part_shape(shape, index), fill_value, dtype=dtype)

    return jax.make_array_from_callback(tuple(shape), sharding, part)


def _part_shape(shape: Sequence[int], index: tuple) -> tuple[int, ...]:
    return tuple(len(range(*i.indices(d))) for i, d in zip(index, shape, strict=True))
