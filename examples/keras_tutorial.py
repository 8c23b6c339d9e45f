"""The TensorFlow tutorial "Distributed training with Keras", on keras_dist.

The program of the tutorial, line for line; only the distribution lines
changed (`tf.distribute.MirroredStrategy` -> `kd.MirroredStrategy`, the
callbacks and `latest_checkpoint` from `kd.callbacks`) and `tf.keras` is
Keras 3. MNIST comes from TFDS; `--mock` uses TFDS's mock data (offline,
random images) so it runs anywhere.

    python examples/keras_tutorial.py [--mock] [--epochs 12] [--workdir DIR]

Needs TFDS: `pip install -e ".[tfds]"` in a checkout of keras_dist.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import contextlib

import keras
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_dist as kd

parser = argparse.ArgumentParser()
parser.add_argument("--mock", action="store_true", help="TFDS mock data (offline)")
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--workdir", default=".")
args = parser.parse_args()
os.makedirs(args.workdir, exist_ok=True)
os.chdir(args.workdir)

mock = (
    tfds.testing.mock_data(num_examples=256, policy=tfds.testing.MockPolicy.USE_CODE)
    if args.mock
    else contextlib.nullcontext()
)
with mock:  # Splits named explicitly: TFDS's mock data has no split metadata.
    (mnist_train, mnist_test), info = tfds.load(
        name="mnist", split=["train", "test"], with_info=True, as_supervised=True
    )

strategy = kd.MirroredStrategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}")

BUFFER_SIZE = 10000
BATCH_SIZE_PER_REPLICA = 64
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync


def scale(image, label):
    image = tf.cast(image, tf.float32)
    image /= 255
    return image, label


train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

with strategy.scope():
    model = keras.Sequential(
        [
            keras.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(),
        metrics=["accuracy"],
    )

# Define the checkpoint directory to store the checkpoints.
checkpoint_dir = "./training_checkpoints"
# Define the name of the checkpoint files.
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}")


# Define a function for decaying the learning rate.
def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


# Put all the callbacks together.
callbacks = [
    keras.callbacks.TensorBoard(log_dir="./logs"),
    kd.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
    kd.callbacks.LearningRateScheduler(decay),
    kd.callbacks.PrintLR(),
]

EPOCHS = args.epochs
model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks, verbose=2)

print(sorted(os.listdir(checkpoint_dir)))

model.load_weights(kd.callbacks.latest_checkpoint(checkpoint_dir))
eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=0)
print(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")

path = "my_model.keras"
model.save(path)

unreplicated_model = keras.models.load_model(path)
eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset, verbose=0)
print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")

with strategy.scope():
    replicated_model = keras.models.load_model(path)
    eval_loss, eval_acc = replicated_model.evaluate(eval_dataset, verbose=0)
    print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")
