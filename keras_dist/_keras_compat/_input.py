"""Seam 1: partial batches — pad and shard on the host, cut back in the step."""

import time
from collections.abc import Callable

import keras

from keras_dist._keras_compat._state import originals as _originals
from keras_dist.cluster import _sync
from keras_dist.data._auto_shard import is_per_process
from keras_dist.data._batch_checks import BatchSignature
from keras_dist.data._multi_process import (
    ProcessBlocks,
    check_pass_end,
    check_pass_start,
)
from keras_dist.data._partial_batch import batch_size_of, unpadding
from keras_dist.data._prefetch import Prefetcher

__all__ = ["_distribute_data", "_get_distributed_iterator", "_jit", "current_strategy"]


def current_strategy():
    from keras_dist.strategies._base import Strategy

    current = keras.distribution.distribution()
    return current if isinstance(current, Strategy) else None


def _jit(fun: Callable, *args, **kwargs):
    step = unpadding(fun)
    if getattr(fun, "__name__", "") == "predict_step":
        from keras_dist._keras_compat._processes import gathered_outputs

        step = gathered_outputs(step)
    return _originals["jit"](step, *args, **kwargs)


def _distribute_data(data, layouts=None):
    strategy = current_strategy()
    if strategy is None:
        return _originals["_distribute_data"](data, layouts)
    return strategy._distribute_batch(data)


def _get_distributed_iterator(self, distribution):
    """Keras's per-pass batch iterator, with keras_dist's checks and padding.

    The batches are produced one step ahead on a background thread (read,
    pad, laid out on the devices while the previous step runs), started at
    the first `next()` so that a resume's replay follows Keras's set-up.
    """
    from keras_dist.strategies._base import Strategy

    if not isinstance(distribution, Strategy):
        return _originals["_get_distributed_iterator"](self, distribution)
    # Named here, on the main thread, in the same order on every process.
    channel = _sync.channel("fit-input") if distribution._spans_processes else ""
    return Prefetcher(_batches(self, distribution, channel), 1, lazy=True)


def _batches(self, distribution, channel: str):
    name = type(self.data_adapter).__name__.removesuffix("Adapter")
    source = f"the {name} input"
    signature = BatchSignature(source)
    skip = _replay(self, distribution)
    batches = self.data_adapter.get_jax_iterator()
    if distribution._spans_processes and is_per_process(
        getattr(self.data_adapter, "_dataset", None)
    ):
        yield from _per_process_batches(
            distribution, batches, signature, skip, source, channel
        )
        return
    index = -1
    stats, start = distribution._input_stats, time.perf_counter()
    for index, data in enumerate(batches):
        if index < skip:
            continue
        signature.check(data, index)
        if index == skip:
            distribution._observed_batch_size = batch_size_of(data)
            if distribution._spans_processes:
                check_pass_start(data, source, channel + "/start")
        batch = distribution._distribute_batch(data)
        stats.record(time.perf_counter() - start, first=index == skip)
        yield batch
        start = time.perf_counter()
    if distribution._spans_processes:
        check_pass_end(index + 1, source, channel + "/end")


def _per_process_batches(strategy, batches, signature, skip, source, channel):
    """Per-process shares (AutoShardPolicy FILE/OFF): agree on every step."""
    blocks = ProcessBlocks(strategy._local_replicas(), source, channel)
    iterator = iter(batches)
    index = 0
    while True:
        data = next(iterator, None)
        if data is not None:
            signature.check(data, index)
        agreed = blocks(data)
        if agreed is None:
            return
        if index >= skip:
            block, rows, num_real = agreed
            yield strategy._distribute_block(block, rows, num_real)
        index += 1


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
