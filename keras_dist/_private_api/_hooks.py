"""Keras classes whose private steps keras_dist changes, as public hooks.

Keras calls these private methods itself and has no public route to change
what they do (each is listed in `_private.PRIVATE_ATTRIBUTES`):

- `BatchNormalization._moments(inputs, mask)`: a training batch's mean and
  variance. keras_dist's layers compute them per replica or over all
  replicas: they override `batch_moments` instead.
- `ModelCheckpoint._save_model(epoch, batch, logs)`: the save Keras's
  `on_train_batch_end` / `on_epoch_end` decide on. keras_dist's callback
  saves in the background: it overrides `save_checkpoint`, with Keras's file
  name (`keras_file_path`) and save decision (`keras_should_save`).

Imports nothing of keras_dist: the layers and callbacks subclass these.
"""

from typing import Any

import keras

__all__ = ["BatchNormalizationHooks", "ModelCheckpointHooks"]


class BatchNormalizationHooks(keras.layers.BatchNormalization):
    """Keras's `BatchNormalization`; `batch_moments` decides its statistics."""

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        return self.batch_moments(inputs, mask)

    def batch_moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        """A training batch's `(mean, variance)`: Keras's own by default."""
        return super()._moments(inputs, mask)

    @property
    def reduction_axes(self) -> list[int]:
        """The axes the statistics reduce over (every axis but `axis`)."""
        return self._reduction_axes


class ModelCheckpointHooks(keras.callbacks.ModelCheckpoint):
    """Keras's `ModelCheckpoint`; `save_checkpoint` is the save it decides on."""

    def _save_model(self, epoch: int, batch: int | None, logs: dict | None) -> None:
        self.save_checkpoint(epoch, batch, logs)

    def save_checkpoint(self, epoch: int, batch: int | None, logs: dict | None) -> None:
        """Saves the model: Keras's own save by default."""
        super()._save_model(epoch=epoch, batch=batch, logs=logs)

    @property
    def current_epoch(self) -> int:
        """The epoch `fit` is in (Keras counts it in `on_epoch_begin`)."""
        return self._current_epoch

    def keras_file_path(self, epoch: int, batch: int | None, logs: dict | None) -> str:
        """The file Keras would save to: `filepath` formatted with the logs."""
        return self._get_file_path(epoch, batch, logs)

    def keras_should_save(
        self, epoch: int, batch: int | None, logs: dict | None, filepath: str
    ) -> bool:
        """Whether Keras would save now (`save_best_only`, its threshold)."""
        return self._should_save_model(epoch, batch, logs, filepath)
