"""One check for the integer arguments of keras_dist and of the Keras calls it wraps.

Keras and keras_dist take counts (`epochs`, `batch_size`, `steps_per_epoch`,
`max_to_keep`, ...) as Python ints. A string (`epochs="2"` read from a
command line), a float (`2.0`, `2.5`), a bool or a count below its minimum
either fails deep inside Keras (`'>' not supported between instances of 'str'
and 'int'`) or is silently misread (`steps_per_epoch=0` means "until the data
runs out"). Every such argument goes through `check_int`, which names the
argument, the value received and the call to write instead. Integral floats
are refused too: Keras itself refuses them (`range(2.0)`), and `2.0` where a
count is expected is usually an arithmetic slip (`n / 2` for `n // 2`).
"""

from typing import Any

import numpy as np

__all__ = ["check_int"]


def check_int(
    value: Any,
    *,
    name: str,
    minimum: int = 1,
    meaning: str = "",
    example: int | None = None,
    error: type[Exception] = ValueError,
) -> int:
    """`value` as an int if it is an integer >= `minimum`; else raises `error`.

    Args:
        value: the argument received.
        name: its name in the message.
        minimum: the smallest value accepted.
        meaning: what the number is, for the message (": the global batch").
        example: a value to suggest when `value` does not suggest one itself.
        error: the exception type (a `ValueError` subclass such as
            `ClusterConfigError`).

    Returns:
        `int(value)`.
    """
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if is_int and value >= minimum:
        return int(value)
    raise error(
        f"`{name}` must be an integer >= {minimum}{meaning}. Received: "
        f"{name}={value!r} (of type {type(value).__name__}). "
        f"{_fix(value, name, minimum, example)}"
    )


def _fix(value: Any, name: str, minimum: int, example: int | None) -> str:
    guess = _as_integer(value)
    if guess is not None and guess >= minimum and not isinstance(value, bool):
        return f"Pass an int: {name}={guess}."
    suggested = example if example is not None else max(minimum, 1)
    return f"For example {name}={suggested}."


def _as_integer(value: Any) -> int | None:
    """The integer a string or integral float spells, if any."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() else None
