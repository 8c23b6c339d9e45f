"""The mark on a wrapper keras_dist installs in place of a Keras function."""

from typing import TypeVar

__all__ = ["marked"]

_F = TypeVar("_F")  # A function, or an object standing for a module (gfile).

# Set by name: a function attribute its declared type does not have.
_MARK = "_keras_dist_wrapped"


def marked(wrapper: _F, original: object) -> _F:
    """`wrapper`, its `_keras_dist_wrapped` attribute the function it wraps."""
    setattr(wrapper, _MARK, original)
    return wrapper
