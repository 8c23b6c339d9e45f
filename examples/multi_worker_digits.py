"""The digits CNN on MultiWorkerMirroredStrategy: one program, N processes.

On one machine (N local processes as one cluster, gloo on CPU):

    keras-dist-run -n 2 --devices-per-process 4 \
        examples/multi_worker_digits.py --epochs 3

On real hosts, set TF_CONFIG (or run under SLURM's `srun`) and start the same
command with `python` on each host. Every process passes the full dataset and
the global batch; keras_dist splits each global batch over the processes. The
chief (process 0) prints the progress and writes the checkpoints; a
restarted run resumes from `BackupAndRestore`'s last backup.
"""

import argparse
import os

import keras
from digits_cnn import create_model, decay, load_data

import keras_dist as kd


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-per-replica", type=int, default=16)
    parser.add_argument("--workdir", default="multi_worker_run")
    parser.add_argument(
        "--seed", type=int, default=None, help="the same run on any cluster layout"
    )
    args = parser.parse_args(argv)

    strategy = kd.MultiWorkerMirroredStrategy()  # Joins the cluster first.
    if args.seed is not None:  # The same on every process.
        keras.utils.set_random_seed(args.seed)
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync
    x_train, x_test, y_train, y_test = load_data()
    if strategy.is_chief:
        print(f"{strategy}; global batch {global_batch}", flush=True)

    with strategy.scope():
        model = create_model()
        model.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    checkpoints = os.path.join(args.workdir, "checkpoints")
    model.fit(
        x_train,
        y_train,
        batch_size=global_batch,
        epochs=args.epochs,
        validation_split=0.1,
        verbose=2,  # The chief prints; the other processes stay quiet.
        callbacks=[
            kd.callbacks.BackupAndRestore(os.path.join(args.workdir, "backup")),
            kd.callbacks.ModelCheckpoint(
                os.path.join(checkpoints, "ckpt_{epoch}.weights.h5"),
                save_weights_only=True,
            ),
            kd.callbacks.LearningRateScheduler(decay),
            kd.callbacks.PrintLR(),
        ],
    )
    _, accuracy = model.evaluate(x_test, y_test, batch_size=global_batch, verbose=0)
    predictions = model.predict(x_test, batch_size=global_batch, verbose=0)
    print(
        f"process {strategy.process_id}: test accuracy {accuracy:.4f}; predict "
        f"returned all {predictions.shape[0]} rows",
        flush=True,
    )
    if strategy.is_chief:
        print("checkpoints:", sorted(os.listdir(checkpoints)), flush=True)


if __name__ == "__main__":
    main()
