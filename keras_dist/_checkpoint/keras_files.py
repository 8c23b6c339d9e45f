"""A Keras file (`.weights.h5`, `.keras`, ...) saved by every process, written once.

With several processes every process runs the same program, so each calls
`model.save_weights(path)`, `model.save(path)` or `keras.saving.save_model`
(the seam `_keras_compat/_save_calls.py` sends those here), and
`ModelCheckpoint` saves on each. Keras alone would have every process write
the same file: h5py's lock refuses the second writer; two processes write
one zip at once. `save_once` makes it one save, as one process does it:

1. **Every process is saving.** The processes agree (an exchange with the
   call-agreement timeout, `CommunicationOptions.timeout_seconds`); a
   process that will not come — ended, or waiting elsewhere — is named at
   once (`if strategy.is_chief: model.save(...)` is an error, not a wait
   in a gather that never ends).
2. **The chief writes.** Every process takes Keras's saving walk and the
   gathers of values split across processes (the save pipeline's snapshot,
   `_keras_compat/_saving.snapshot`); the chief (process 0) writes it
   through Keras's `H5IOStore` (`write_snapshot`) under a temporary name,
   renamed when complete (`atomic_write`). A format the snapshot does not
   write (legacy `.h5`, sharded `.weights.json`, an unzipped or `hf://`
   model, or a file Keras would ask before overwriting) is Keras's own
   function on every process, the others writing into a scratch directory
   (their walks take part in the same gathers).
3. **Every process returns when the file is complete**, or raises: the
   chief's error on the others as `CheckpointWriteError`.

With one process it is `atomic_write` around Keras's own function.
"""

import os
import tempfile
from collections.abc import Callable

import jax

from keras_dist._checkpoint.pipeline import atomic_write
from keras_dist._keras_compat._saving import snapshot, write_snapshot
from keras_dist.cluster import _sync
from keras_dist.errors import CheckpointWriteError

__all__ = ["save_once", "written_everywhere"]

_SINGLE_FILES = (".weights.h5", ".keras", ".h5", ".hdf5")


def save_once(
    model,
    filepath: str,
    save: Callable[[str], object],
    *,
    weights_only: bool,
    method: str,
    overwrite: bool = True,
    snapshot_format: bool = True,
) -> None:
    """`save(path)` (Keras's function, bound to its other arguments) as one
    save of every process; `filepath` written once, by the chief.

    Args:
        model: the model saved.
        filepath: where the user asked for the file.
        save: Keras's own function, called with the path to write.
        weights_only: a `.weights.h5` file (else a `.keras` model).
        method: the call, for messages (`"model.save_weights"`).
        overwrite: the call's `overwrite`.
        snapshot_format: the call's other arguments leave the file to the
            snapshot's writer (no `max_shard_size`, zipped, not `hf://`).

    Raises:
        ProcessMismatchError: if a process is not saving (names it).
        CheckpointWriteError: on the other processes, if the chief's write
            failed (its error).
    """
    path = os.fspath(filepath)
    single = path.endswith(_SINGLE_FILES) and not path.startswith("hf://")
    atomic = single and (overwrite or not os.path.exists(path))
    if jax.process_count() == 1:
        if atomic:
            atomic_write(path, save)
        else:
            save(path)
        return
    rule = (
        f"Call `{method}` on every process: keras_dist saves once, the chief "
        "(process 0) writes the file and the others wait for it."
    )
    _sync.allgather("save", {"method": method}, rule=rule)
    chief = jax.process_index() == 0
    suffix = ".weights.h5" if weights_only else ".keras"
    error = None
    try:
        if atomic and snapshot_format and path.endswith(suffix):
            _write_snapshot(model, path, weights_only=weights_only, chief=chief)
        elif chief:
            atomic_write(path, save) if atomic else save(path)
        else:
            with tempfile.TemporaryDirectory(prefix="keras_dist-scratch-") as scratch:
                save(os.path.join(scratch, os.path.basename(path) or "file"))
    except BaseException as failure:
        error = failure
    written_everywhere(error, what=f"{path!r} for `{method}`", rule=rule)


def written_everywhere(
    error: BaseException | None, *, what: str, rule: str = ""
) -> None:
    """Every process returns once the chief's files are complete: raises
    `error` (this process's), or on the others the chief's.

    Every process calls it after its part of a save (`error`: what that
    part raised, or None).

    Raises:
        CheckpointWriteError: on a process other than the chief, if the
            chief's part failed (its error).
    """
    if jax.process_count() > 1:
        outcome = None if error is None else f"{type(error).__name__}: {error}"[:500]
        outcomes = _sync.allgather("save-done", outcome, rule=rule)
    else:
        outcomes = [None]
    if error is not None:
        raise error
    if outcomes[0] is not None:
        raise CheckpointWriteError(
            f"The chief (process 0) could not write {what}: {outcomes[0]}. "
            "See the chief's log."
        )


def _write_snapshot(model, path: str, *, weights_only: bool, chief: bool) -> None:
    """Every process: the walk and the gathers; the chief: the file."""
    snap = snapshot(model, with_config=not weights_only, copy_local=chief)
    try:
        if chief:
            atomic_write(path, lambda p: write_snapshot(snap, p))
    finally:
        snap.release()
