"""`ShardedCheckpoints`: `ModelCheckpoint(sharded=True)`'s Orbax directory.

The layout is `keras.callbacks.OrbaxCheckpoint`'s (a directory per step,
checkpointables `pytree` and `model_config`), so `keras.models.load_model`
and `model.load_weights` read it, and `kd.callbacks.ModelCheckpoint` and
Keras's callback read each other's. Each process writes the parts of the
state it holds (nothing is gathered on one host); Orbax commits a step by
a rename once every part is written.
"""

import os

from keras_dist._keras_compat._saving import orbax_payload
from keras_dist.callbacks._background import write_failed

__all__ = ["ShardedCheckpoints"]


def _v1():
    import orbax.checkpoint as ocp

    return ocp.v1


class ShardedCheckpoints:
    """Numbered Orbax checkpoints of a model; one save in flight."""

    def __init__(
        self,
        directory: str,
        *,
        async_save: bool,
        max_to_keep: int | None,
        keep_period: int | None,
    ):
        ocp = _v1()
        policies = ocp.training.preservation_policies
        kept = [policies.LatestN(max_to_keep)] if max_to_keep else []
        if keep_period:
            kept.append(policies.EveryNSteps(keep_period))
        if not kept:
            preservation = policies.PreserveAll()
        elif len(kept) == 1:
            preservation = kept[0]
        else:
            preservation = policies.AnyPreservationPolicy(kept)
        self.directory = directory
        self.async_save = async_save
        self._response = None
        self._step: int | None = None
        self._checkpointer = ocp.training.Checkpointer(
            directory,
            preservation_policy=preservation,
            save_decision_policy=ocp.training.save_decision_policies.FixedIntervalPolicy(
                1
            ),
            cleanup_tmp_directories=True,
        )

    def steps(self) -> list[int]:
        return sorted(c.step for c in self._checkpointer.checkpoints)

    def save(self, model, step: int, *, weights_only: bool) -> str | None:
        """Starts saving `model` as `step`; its directory (None if it exists)."""
        payload = orbax_payload(model, weights_only=weights_only)
        self.wait()
        if step in self.steps():  # The same step (an epoch end after a save).
            return None
        self._step = step
        with _v1().Context():
            self._response = self._checkpointer.save_checkpointables_async(
                step, payload
            )
        if not self.async_save:
            self.wait()
        return os.path.join(self.directory, str(step))

    def check(self) -> None:
        """Raises the error of a save that failed; never waits."""
        if self._response is None or self._checkpointer.is_saving_in_progress():
            return
        self.wait()

    def wait(self) -> None:
        response, self._response = self._response, None
        if response is None:
            return
        try:
            response.result()
        except Exception as error:
            raise write_failed(
                "ModelCheckpoint",
                os.path.join(self.directory, str(self._step)),
                error,
                f"The earlier checkpoints in {self.directory} are intact.",
            ) from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._checkpointer.close()
