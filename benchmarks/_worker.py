"""One benchmark configuration, run in a fresh process; prints one JSON line.

    python benchmarks/_worker.py CONFIG MODEL DEVICES STEPS EPOCHS GLOBAL_BATCH

CONFIG is one of
    A    Keras fit on one device (keras_dist OneDeviceStrategy)
    B    keras_dist MirroredStrategy fit on DEVICES devices
    B32  B compiled with steps_per_execution=32
    BU   B with keras_dist's pacing off (`strategy.pacer.enabled = False`):
         what the pacer costs (XLA:CPU may abort such a run)
    B32U B32 with keras_dist's pacing off
    BH   B on the host path (`InputOptions(device_resident=False)`): each
         batch copied from NumPy during the epoch, as for data beyond the
         device-resident budget, tf.data, Grain or a PyDataset
    BH32 BH with steps_per_execution=32
    BN   B whose `train_step` does no work (returns the state as it got
         it): the floor of Keras's own per-step loop (callbacks, logs, the
         iterator) under keras_dist
    BN32 BN with steps_per_execution=32
    BR   BS with a budget no copy fits (`InputOptions(device_resident=True,
         device_resident_budget=0)`): the data is split over the devices
         by rows, and each epoch lays its batches out once from them (one
         all_to_all); each step then takes its block, as in order
    BS   B with shuffle=True, the data copied to every device (a budget any
         copy fits: on CPU devices the default budget counts the 8 copies
         in the one RAM, and the tiny model's would go through the host):
         each step gathers its rows of the device-resident
         data (every other configuration reads the data in order, which
         keras_dist lays out as blocks split over the devices)
    C    Keras 3's keras.distribution.DataParallel on the same devices, used
         as Keras documents it: model built, compiled and fit inside
         `with distribution.scope():`
    CS   C with shuffle=True (Keras's default; what BS is measured against)
    C0   the pitfall: the same DataParallel model built and compiled in the
         scope, `fit` called outside it (Keras then trains without the
         distribution; a keras_dist model remembers its strategy)
    D    TensorFlow tf.distribute.MirroredStrategy + Keras on the TF backend
         (DEVICES logical CPU devices, or the GPUs)
    E    the limit: a hand-written jax.jit + optax step over the same mesh,
         one step a dispatch, the data laid out on the devices ahead of
         time (`_limit.py`)
    E32  E with 32 steps a dispatch (a jax.lax.scan; what B32 is measured
         against)
    EK   E with Keras's Adam (`optimizer.stateless_apply`) in place of
         optax's: the limit for the step math Keras runs (B's), so that
         B/EK is what keras_dist's fit adds and EK/E what Keras's Adam costs
    EK32 E32 with Keras's Adam
    EKU  EK with no bound on the programs in flight (the loop as JAX's
         tutorials write it; XLA:CPU may abort it)
    EK32U EK32 with no bound on the programs in flight
    EKH  EK on the host path: each batch copied from NumPy by `device_put`
         on a thread, one step ahead (double-buffered): the limit of BH
    EKH32 EK32 on the host path: the 32 batches of a dispatch stacked and
         copied as one, one dispatch ahead: the limit of BH32
    F    keras_dist custom training loop (strategy.run) on the same mesh

Every configuration trains MODEL on the same synthetic data at the same global
batch for 1 + EPOCHS epochs of STEPS steps; the first epoch (compilation) is
not timed. Prints `RESULT {json}` with the ms/step of each timed epoch, and
the CPU time per step of the main thread (`time.thread_time`: the Python
loop and the dispatches; not XLA's threads, nor an input thread). JAX's
default backend must be the benchmark's platform (`--platform`), with at
least DEVICES devices: the worker exits with the reason otherwise.
"""

import os
import resource
import sys
import time

from _runs import force_host_devices, print_result

CONFIG, MODEL = sys.argv[1], sys.argv[2]
DEVICES, STEPS, EPOCHS, BATCH = (int(v) for v in sys.argv[3:7])
PLATFORM = force_host_devices(8)
os.environ["KERAS_BACKEND"] = "tensorflow" if CONFIG == "D" else "jax"

import numpy as np  # noqa: E402

LIMIT_CONFIGS = (
    "E",
    "E32",
    "EK",
    "EK32",
    "EKU",
    "EK32U",
    "EKH",
    "EKH32",
)  # The hand-written limit: `_limit.py`.
SHAPES = {"tiny": (28, 28, 1), "cnn": (28, 28, 1), "resnet": (32, 32, 3)}


def make_model(keras, name):
    layers = keras.layers
    inputs = keras.Input(SHAPES[name])
    if name == "tiny":  # Isolates per-step framework overhead.
        outputs = layers.Dense(10)(layers.Flatten()(inputs))
    elif name == "cnn":  # The seeds' MNIST CNN.
        x = layers.Conv2D(32, 3, activation="relu")(inputs)
        x = layers.MaxPooling2D()(x)
        x = layers.Dense(64, activation="relu")(layers.Flatten()(x))
        outputs = layers.Dense(10)(x)
    else:  # A small ResNet: the compute-heavier model.
        x = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        for filters in (32, 64):
            strides = 1 if filters == 32 else 2
            shortcut = layers.Conv2D(filters, 1, strides=strides)(x)
            y = layers.Conv2D(filters, 3, strides=strides, padding="same")(x)
            y = layers.Activation("relu")(layers.BatchNormalization()(y))
            y = layers.Conv2D(filters, 3, padding="same")(y)
            x = layers.Activation("relu")(layers.Add()([shortcut, y]))
        outputs = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    if CONFIG.startswith("BN"):  # The floor of Keras's loop: a step doing nothing.

        class Idle(keras.Model):
            def train_step(self, state, data):
                return {}, state

        return Idle(inputs, outputs)
    return keras.Model(inputs, outputs)


def set_initial_weights(model):
    """The same kernels in every configuration, without seeding TF.

    (`keras.utils.set_random_seed` imports TensorFlow: seconds per process.)
    """
    rng = np.random.RandomState(1)
    for v in model.weights:
        if v.path.endswith("kernel"):
            fan = float(np.prod(v.shape[:-1]))
            v.assign(rng.normal(0, (2.0 / fan) ** 0.5, v.shape).astype("float32"))
    return model


def make_data():
    rng = np.random.RandomState(0)
    n = STEPS * BATCH
    x = rng.rand(n, *SHAPES[MODEL]).astype("float32")
    y = rng.randint(0, 10, size=n).astype("int32")
    return x, y


# The main thread's CPU seconds of each epoch (`time.thread_time`).
HOST_CPU_SECONDS: list = []


def fit_and_time(keras, model, x, y, extra_callbacks=(), shuffle=False):
    class EpochTimer(keras.callbacks.Callback):
        seconds: list = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()
            self.cpu = time.thread_time()

        def on_epoch_end(self, epoch, logs=None):  # Keras waits for results here.
            self.seconds.append(time.perf_counter() - self.start)
            HOST_CPU_SECONDS.append(time.thread_time() - self.cpu)

    timer = EpochTimer()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1 + EPOCHS,
        shuffle=shuffle,
        verbose=0,
        callbacks=[timer, *extra_callbacks],
    )
    losses = history.history.get("loss", [float("nan")])  # BN: no loss.
    return timer.seconds, float(losses[-1])


def compile_model(keras, model, steps_per_execution=1):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return model


def mesh_devices():
    """The first DEVICES devices of the benchmark's platform, or exit saying why."""
    import jax

    backend, devices = jax.default_backend(), jax.devices()
    if backend != PLATFORM or len(devices) < DEVICES:
        sys.exit(
            f"--platform {PLATFORM} --devices {DEVICES} is not available here. "
            f"Received: JAX default backend {backend!r} with {len(devices)} "
            "devices. Install JAX for that platform, or pass fewer --devices."
        )
    return devices[:DEVICES]


def run_keras_fit():
    import keras

    import keras_dist as kd

    x, y = make_data()
    # Keras's shuffle draws from NumPy's global state: BS and BR, the same.
    np.random.seed(0)
    devices = mesh_devices()
    if CONFIG == "A":
        strategy = kd.OneDeviceStrategy(devices[0])
    elif CONFIG.startswith("B"):
        strategy = kd.MirroredStrategy(list(devices))
        if CONFIG.endswith("U"):  # No pacing: what it costs.
            strategy.pacer.enabled = False
    else:  # C, C0: Keras's own data parallelism, no keras_dist involved.
        strategy = keras.distribution.DataParallel(devices=list(devices))
    if CONFIG in ("BS", "BR"):  # Copies; split by rows.
        strategy.input_options = kd.InputOptions(
            device_resident=True, device_resident_budget=2**40 if CONFIG == "BS" else 0
        )
    if CONFIG.startswith("BH"):  # The host path.
        strategy.input_options = kd.InputOptions(device_resident=False)
    report, extra = None, ()
    if CONFIG not in ("C", "C0", "CS"):
        report = kd.utils.ScalingReport(print_summary=False)
        extra = (report,)
    with strategy.scope():
        model = set_initial_weights(make_model(keras, MODEL))
        compile_model(keras, model, 32 if "32" in CONFIG else 1)
        if CONFIG != "C0":
            seconds, loss = fit_and_time(
                keras, model, x, y, extra, shuffle=CONFIG in ("BS", "BR", "CS")
            )
    if CONFIG == "C0":  # The pitfall: fit after the scope has closed.
        seconds, loss = fit_and_time(keras, model, x, y, extra)
    return seconds, loss, report.result if report else None


def run_tf_fit():
    import tensorflow as tf

    if PLATFORM == "cpu":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES
        )
        names = [f"/cpu:{i}" for i in range(DEVICES)]
    else:
        names = [f"/gpu:{i}" for i in range(DEVICES)]
    import keras

    x, y = make_data()
    strategy = tf.distribute.MirroredStrategy(names)
    with strategy.scope():
        model = compile_model(keras, set_initial_weights(make_model(keras, MODEL)))
    seconds, loss = fit_and_time(keras, model, x, y)
    return seconds, loss, None


def run_jax_loop():
    import jax
    import keras
    import optax
    from _limit import limit_epoch

    import keras_dist as kd

    x, y = make_data()
    model = set_initial_weights(make_model(keras, MODEL))
    devices = mesh_devices()
    if CONFIG in LIMIT_CONFIGS:
        epoch, state = limit_epoch(
            keras, model, x, y, devices, config=CONFIG, steps=STEPS, batch=BATCH
        )
    else:  # F: keras_dist's replica API, input through a distributed dataset.
        optimizer = optax.adam(1e-3)
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        strategy = kd.MirroredStrategy(list(devices))
        batches = [
            (x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)
        ]
        dataset = strategy.experimental_distribute_dataset(batches)
        per_example = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None
        )

        def replica_step(state, xb, yb):
            trainable, non_trainable, opt_state = state

            def loss_of(trainable):
                logits, non_trainable_new = model.stateless_call(
                    trainable, non_trainable, xb, training=True
                )
                loss = kd.losses.compute_average_loss(per_example(yb, logits))
                return loss, non_trainable_new

            (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(
                trainable
            )
            updates, opt_state = optimizer.update(grads, opt_state, trainable)
            new = (optax.apply_updates(trainable, updates), non_trainable, opt_state)
            return kd.get_replica_context().all_reduce("sum", loss), new

        state = jax.device_put(
            (trainable, non_trainable, optimizer.init(trainable)),
            strategy.state_layout.replicated,
        )

        def epoch(state):
            for xb, yb in dataset:
                loss, state = strategy.run(replica_step, args=(state, xb, yb))
            return jax.block_until_ready((loss, state))

    seconds = []
    for _ in range(1 + EPOCHS):
        start, cpu = time.perf_counter(), time.thread_time()
        loss, state = epoch(state)
        seconds.append(time.perf_counter() - start)
        HOST_CPU_SECONDS.append(time.thread_time() - cpu)
    return seconds, float(loss), None


def main():
    keras_fits = ("A", "B", "B32", "BU", "B32U", "BS", "BR", "C", "C0", "CS")
    keras_fits += ("BH", "BH32", "BN", "BN32")
    runner = dict.fromkeys(keras_fits, run_keras_fit)
    runner.update(dict.fromkeys((*LIMIT_CONFIGS, "F"), run_jax_loop))
    runner.update(D=run_tf_fit)
    seconds, loss, report = runner[CONFIG]()
    timed = seconds[1:]
    result = {
        "config": CONFIG,
        "model": MODEL,
        "devices": DEVICES,
        "steps": STEPS,
        "global_batch": BATCH,
        "first_epoch_s": seconds[0],
        "ms_per_step": [s / STEPS * 1e3 for s in timed],
        "host_cpu_ms_per_step": [s / STEPS * 1e3 for s in HOST_CPU_SECONDS[1:]],
        "final_loss": loss,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if report is not None:
        result["scaling_report"] = {
            k: report[k]
            for k in ("compile_seconds", "input_ms_per_step", "input_fraction")
        }
    print_result(result)


if __name__ == "__main__":
    main()
