"""Seam 1: partial batches — pad and shard on the host, cut back in the step."""

from collections.abc import Callable

import keras

from keras_dist._keras_compat._state import originals as _originals
from keras_dist.data._batch_checks import BatchSignature
from keras_dist.data._partial_batch import batch_size_of, unpadding

__all__ = ["_distribute_data", "_get_distributed_iterator", "_jit", "current_strategy"]


def current_strategy():
    from keras_dist.strategies._base import Strategy

    current = keras.distribution.distribution()
    return current if isinstance(current, Strategy) else None


def _jit(fun: Callable, *args, **kwargs):
    return _originals["jit"](unpadding(fun), *args, **kwargs)


def _distribute_data(data, layouts=None):
    strategy = current_strategy()
    if strategy is None:
        return _originals["_distribute_data"](data, layouts)
    return strategy._distribute_batch(data)


def _get_distributed_iterator(self, distribution):
    """Keras's per-pass batch iterator, with keras_dist's checks and padding."""
    from keras_dist.strategies._base import Strategy

    if not isinstance(distribution, Strategy):
        yield from _originals["_get_distributed_iterator"](self, distribution)
        return
    name = type(self.data_adapter).__name__.removesuffix("Adapter")
    signature = BatchSignature(f"the {name} input")
    skip = _replay(self, distribution)
    for index, data in enumerate(self.data_adapter.get_jax_iterator()):
        if index < skip:
            continue
        signature.check(data, index)
        if index == 0:
            distribution._observed_batch_size = batch_size_of(data)
        yield distribution._distribute_batch(data)


def _replay(epoch_iterator, strategy) -> int:
    """Carries out a pending `ResumePlan`; returns the batches to skip."""
    plan = getattr(strategy, "_resume_plan", None)
    if plan is None:
        return 0
    strategy._resume_plan = None
    adapter = epoch_iterator.data_adapter
    for _ in range(plan.replay_passes):  # Repeat every random draw of the input.
        for _ in adapter.get_jax_iterator():
            pass
        adapter.on_epoch_end()
        adapter.on_epoch_begin()
    # Keras counts the epoch's steps; the skipped ones are already done.
    epoch_iterator._steps_seen += plan.skip_batches
    return plan.skip_batches
