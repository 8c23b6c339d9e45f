"""kd.errors: one named exception per diagnosis, catchable as the builtin."""

import keras_dist as kd
from keras_dist._checkpoint import orbax_store
from keras_dist.errors import ProcessMismatchError, StrategyMismatchError


def test_process_mismatch_is_caught_as_before():
    assert issubclass(ProcessMismatchError, ValueError)
    assert issubclass(ProcessMismatchError, StrategyMismatchError)
    try:
        raise ProcessMismatchError("The processes disagree.")
    except ValueError as error:  # What `_processes` raised before.
        assert str(error) == "The processes disagree."


def test_every_error_is_exported():
    names = set(kd.errors.__all__)
    assert {"ProcessMismatchError", "IncompatibleBackupError"} <= names
    assert kd.errors.IncompatibleBackupError is orbax_store.IncompatibleBackupError
    for name in names:
        assert issubclass(getattr(kd.errors, name), Exception)
