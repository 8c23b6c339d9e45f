"""The hand-written limit (configs E, E32, EK, EK32, EKU, EK32U of `_worker.py`).

A `jax.jit` step over the mesh, as JAX's sharding tutorial writes it: the
state replicated, each batch split over the devices, the batches laid out on
the devices ahead of time. The model's forward is Keras's `stateless_call`
(traced once); the optimizer is optax's Adam (E, E32) or Keras's
(`stateless_apply`: EK, EK32, the step math keras_dist's `fit` runs). E and
EK dispatch one step at a time; E32 and EK32 run 32 steps as one program, a
`jax.lax.scan` over 32 batches stacked on the devices, each step's batch
constrained to E's layout. At most 8 programs are in flight, as keras_dist
keeps them on CPU devices (unbounded, XLA:CPU aborted most runs:
`keras_dist/strategies/placement/_placement.py`); EKU and EK32U are EK and EK32 with
no such bound (the loop as JAX's tutorials write it: what the pacing costs,
and whether these runs abort). EKH and EKH32 are EK and EK32 on the host
path: each dispatch's batches (one, or 32 stacked) copied from NumPy by one
`jax.device_put` on a thread, one dispatch ahead of the step (the double
buffering flax's examples write) — the limit for `fit` on input that is not
device-resident.
"""

import queue
import sys
import threading

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def limit_epoch(keras, model, x, y, devices, *, config: str, steps: int, batch: int):
    """`(epoch, state)`: `epoch(state) -> (loss, state)` trains one epoch.

    `loss` is the last step's; `epoch` returns when its programs are done.
    """
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    init_optimizer, apply_gradients = adam(
        keras, model.trainable_variables, keras_adam=("K" in config)
    )
    mesh = Mesh(np.array(devices), ("batch",))
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_rows = NamedSharding(mesh, PartitionSpec("batch"))
    per_dispatch = 32 if "32" in config else 1
    paced = not config.endswith("U")
    if steps % per_dispatch:
        sys.exit(f"{config} runs 32 steps a dispatch. Received: STEPS={steps}.")

    def step(state, xb, yb):
        trainable, non_trainable, opt_state = state

        def loss_of(trainable):
            logits, non_trainable_new = model.stateless_call(
                trainable, non_trainable, xb, training=True
            )
            return loss_fn(yb, logits), non_trainable_new

        (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(
            trainable
        )
        trainable, opt_state = apply_gradients(grads, opt_state, trainable)
        return loss, (trainable, non_trainable, opt_state)

    def scanned(state, xs, ys):  # `per_dispatch` steps, one program.
        def body(state, rows):
            # Each step's batch split over the devices, as E's. (On CPU a
            # scan of a convolution stays slow: jax-ml/jax#12868.)
            rows = jax.lax.with_sharding_constraint(rows, batch_rows)
            loss, state = step(state, *rows)
            return state, loss

        state, losses = jax.lax.scan(body, state, (xs, ys))
        return losses[-1], state

    program = jax.jit(step if per_dispatch == 1 else scanned)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    state = jax.device_put(
        (trainable, non_trainable, init_optimizer(trainable)), replicated
    )
    groups = steps // per_dispatch
    if per_dispatch == 1:
        shape, spec = (groups, batch), PartitionSpec(None, "batch")
    else:
        shape, spec = (groups, per_dispatch, batch), PartitionSpec(None, None, "batch")
    laid_out = NamedSharding(mesh, spec)
    host_x = x[: np.prod(shape)].reshape(*shape, *x.shape[1:])
    host_y = y[: np.prod(shape)].reshape(shape)
    if "H" in config:  # The host path: each dispatch's batches copied in the epoch.
        per_dispatch_layout = NamedSharding(mesh, PartitionSpec(*spec[1:]))

        def batches_of_epoch():
            return double_buffered(
                lambda i: jax.device_put((host_x[i], host_y[i]), per_dispatch_layout),
                groups,
            )

    else:
        xs, ys = jax.device_put(host_x, laid_out), jax.device_put(host_y, laid_out)
        on_device = [(xs[i], ys[i]) for i in range(groups)]
        jax.block_until_ready(on_device)

        def batches_of_epoch():
            return iter(on_device)

    def epoch(state):
        in_flight = []  # At most 8 programs in flight (XLA:CPU).
        for xb, yb in batches_of_epoch():
            loss, state = program(state, xb, yb)
            if paced:
                in_flight.append(loss)
                if len(in_flight) > 8:
                    in_flight.pop(0).block_until_ready()
        return jax.block_until_ready((loss, state))

    return epoch, state


def double_buffered(copy, count: int):
    """`copy(0) ... copy(count - 1)`, each made on a thread one item ahead."""
    ready: queue.Queue = queue.Queue(maxsize=1)
    thread = threading.Thread(
        target=lambda: [ready.put(copy(i)) for i in range(count)], daemon=True
    )
    thread.start()
    for _ in range(count):
        yield ready.get(timeout=600)
    thread.join(timeout=60)


def adam(keras, variables: list, *, keras_adam: bool):
    """Adam(1e-3) for `variables`, optax's or Keras's (as B's compile builds it).

    Returns `(init(trainable), apply(grads, opt_state, trainable))`, `apply`
    giving `(trainable, opt_state)`; also `optimizer_update.py`'s two Adams.
    """
    if not keras_adam:
        adam = optax.adam(1e-3)

        def apply(grads, opt_state, trainable):
            updates, opt_state = adam.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state

        return adam.init, apply
    adam = keras.optimizers.Adam(1e-3)
    adam.build(variables)

    def init(trainable):
        return [v.value for v in adam.variables]

    def apply(grads, opt_state, trainable):
        return adam.stateless_apply(opt_state, grads, trainable)

    return init, apply
