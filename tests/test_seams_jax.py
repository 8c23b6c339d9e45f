"""`seams()` also lists private JAX names and the Keras hooks strategies override."""

import keras
import pytest
from jax._src import xla_bridge

from keras_dist import _seams
from keras_dist._seams import JAX_PRIVATE, KERAS_HOOKS


def _owner_of(cls, name):
    return next(c for c in cls.__mro__ if name in vars(c))


def test_seams_lists_jax_names_and_keras_hooks():
    found = _seams.seams()
    for module, path in (*JAX_PRIVATE, *KERAS_HOOKS):
        assert f"{module}.{path}" in found
    hook = found["keras.distribution.DataParallel.num_processes"]
    assert hook is keras.distribution.DataParallel.num_processes


def test_a_moved_keras_hook_fails_loudly(monkeypatch):
    owner = _owner_of(keras.distribution.DataParallel, "num_processes")
    monkeypatch.delattr(owner, "num_processes")
    with pytest.raises(
        ImportError,
        match=r"checked against Keras 3\.15\.1 and keras-nightly "
        r"3\.16\.0\.dev2026102704; .*no longer has "
        r"\[.*num_processes.*Install `keras>=3\.15,<3\.17`",
    ):
        _seams.seams()


def test_a_moved_private_jax_name_fails_loudly(monkeypatch):
    monkeypatch.delattr(xla_bridge, "_backends")
    with pytest.raises(
        ImportError, match=r"checked against JAX 0\.10\.x.*xla_bridge\._backends"
    ):
        _seams.seams()


def test_the_jax_coordination_client_attribute_is_there():
    state = _seams.seams()["jax._src.distributed.global_state"]
    assert hasattr(state, "client")  # None until the cluster is joined.
