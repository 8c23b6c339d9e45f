"""`steps_per_execution=N` as one compiled program for N steps.

Keras's JAX trainer runs `steps_per_execution=N` as a Python loop over its
compiled step (`JAXTrainer._make_function`): N dispatches and N host
round trips of the state's pytree for one callback call. Under a keras_dist
strategy a group of N batches runs as one program instead: `lax.scan` of
the same step over the N batches (`data/_batch_group.BatchGroup`), the state
as the scan's carry. One dispatch per N steps; callbacks still run after
each group, at the step numbers Keras gives them.

The numbers are those of Keras's loop: the same step function, run N times
in order (to float tolerance: XLA may fuse the loop body differently). A
group is fused only when its N batches have one structure, shapes and dtypes
(a padded partial batch has another structure); any other group — the
shorter last group of an epoch, a group with a partial last batch — runs
through Keras's own loop, batch by batch, with the one-step program.

For `predict` the outputs of the N steps are concatenated along the batch
axis, as Keras concatenates them; for `fit` and `evaluate` the logs are the
last step's, as Keras returns them.

On CPU devices a step with a convolution is not fused: XLA:CPU runs a
convolution inside a loop far slower than alone (jax-ml/jax#12868), so the
fused group would cost more than the dispatches it saves (`python
benchmarks/single_vs_mirrored.py --models resnet --configs B,B32,E,E32`
measures it). The first group decides, from the program's jaxpr; every
group then runs through Keras's loop.
"""

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from keras_dist.data._batch_group import BatchGroup, read_group

__all__ = ["FusedSteps", "batch_by_batch", "has_primitive", "loops_slowly"]


class FusedSteps:
    """Keras's `iterator_step(state, iterator)`, N steps in one program.

    Args:
        step: the step `step(state, batch) -> (outputs, state)`, not jitted
            (the seams' step: it gathers device-resident batches and cuts
            padded ones).
        jit: compiles a function `(state, shared, varying) -> (outputs,
            state)` as Keras compiles its step (state donated, Keras's
            output shardings).
        steps: N, `steps_per_execution`.
        concatenate: concatenate the steps' outputs (predict) instead of
            keeping the last step's (fit, evaluate).
        keras_loop: Keras's own `iterator_step` over the one-step program,
            for groups that cannot be fused.
        enabled: whether to fuse, asked at each group (the strategy's
            `input_options.fuse_steps`); Keras's loop when it says no.
    """

    def __init__(
        self,
        step: Callable,
        jit: Callable[[Callable], Callable],
        *,
        steps: int,
        concatenate: bool,
        keras_loop: Callable,
        enabled: Callable[[], bool] = lambda: True,
    ):
        self._step = step
        self._jit = jit
        self._steps = steps
        self._concatenate = concatenate
        self._keras_loop = keras_loop
        self._enabled = enabled
        self._programs: dict[Any, Callable] = {}
        self._loops_slowly: bool | None = None  # Decided at the first group.

    def __call__(self, state, iterator: Iterator):
        if not self._enabled() or self._loops_slowly:
            return self._keras_loop(state, iterator)
        group = _next_group(iterator, self._steps)
        if not isinstance(group, BatchGroup):
            return self._keras_loop(state, iter(group))
        if self._loops_slowly is None:
            self._loops_slowly = loops_slowly(self._fused(group), state, group)
            if self._loops_slowly:
                read_singly = getattr(iterator, "read_singly", None)
                if read_singly is not None:  # Lays out no more groups.
                    read_singly()
                return self._keras_loop(state, iter(group.batches(self._steps)))
        key = (group.treedef, group.is_shared)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._jit(self._fused(group))
        return program(state, group.shared, group.varying)

    def _fused(self, like: BatchGroup) -> Callable:
        step, concatenate = self._step, self._concatenate

        def fused(state, shared, varying):
            group = BatchGroup(like.treedef, like.is_shared, shared, varying)
            stacked = [jnp.stack(v) if isinstance(v, tuple) else v for v in varying]

            def body(state, rows):
                outputs, state = step(state, group.batch(rows))
                return state, outputs

            # State the step returns unchanged (an evaluate or predict
            # step's weights) is forwarded by `lax.scan` itself: the
            # program's output is then its input, aliased, and
            # CentralStorage's host-memory weights are not copied back
            # (tests: the jaxpr, and the compiled HLO).
            state, outputs = jax.lax.scan(body, state, stacked)
            last_or_all = _join_steps if concatenate else (lambda o: o[-1])
            return jax.tree.map(last_or_all, outputs), state

        return fused


def loops_slowly(fused: Callable, state: Any, group: BatchGroup) -> bool:
    """Whether `fused(state, group...)` would be slower than a loop of steps.

    True on CPU devices when the step has a convolution (jax-ml/jax#12868).
    """
    arrays = [
        leaf
        for leaf in jax.tree.leaves((state, group.shared, group.varying))
        if isinstance(leaf, jax.Array)
    ]
    if not arrays:
        return False
    # Annotated: jax's stubs leave the type of `device_set`'s items unresolved.
    devices: set[jax.Device] = arrays[0].sharding.device_set
    if any(d.platform != "cpu" for d in devices):
        return False
    # Shapes only: state kept in host memory (CentralStorage) is brought to
    # the devices by the compiled program's wrapper, not by `fused`.
    shapes = jax.tree.map(
        lambda a: (
            jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.Array) else a
        ),
        (state, group.shared, group.varying),
    )
    jaxpr = jax.make_jaxpr(fused)(*shapes)
    return has_primitive(jaxpr.jaxpr, "conv_general_dilated")


def has_primitive(jaxpr: Any, name: str) -> bool:
    """Whether `jaxpr` (a `Jaxpr`) or one nested in it applies primitive `name`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return True
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # A `ClosedJaxpr`'s own.
                if hasattr(inner, "eqns") and has_primitive(inner, name):
                    return True
    return False


def _next_group(iterator: Iterator, count: int) -> BatchGroup | list:
    """The next `count` batches: laid out at once where the input can."""
    read = getattr(iterator, "next_group", None)
    return read(count) if read is not None else read_group(iterator, count)


def _join_steps(outputs):
    """(N, B, ...) outputs of N steps -> (N * B, ...), as Keras concatenates."""
    return outputs.reshape((-1, *outputs.shape[2:]))


def batch_by_batch(step: Callable, steps: int, concatenate: bool) -> Callable:
    """`iterator_step(state, iterator)`: up to `steps` batches, one step each.

    The loop of Keras 3.15's `_make_function`, which the nightly replaced by
    a scan over stacked super-batches: the steps run in order, a group stops
    where the epoch's batches end, and `predict`'s outputs are concatenated
    along the batch axis (`fit`'s and `evaluate`'s are the last step's).
    """

    def iterator_step(state: Any, iterator: Iterator) -> tuple[Any, Any]:
        outputs, state = step(state, next(iterator))
        collected = [outputs]
        for _ in range(steps - 1):
            try:
                batch = next(iterator)
            except StopIteration:
                break
            outputs, state = step(state, batch)
            collected.append(outputs)
        if concatenate and len(collected) > 1:
            outputs = jax.tree.map(lambda *parts: jnp.concatenate(parts), *collected)
        return outputs, state

    return iterator_step
