"""Deprecated forwards: the input machinery that was public on every strategy.

`strategy.shard`, `take_rows` and the rest moved to `strategy.placement`
(where laying data out has one verb, `lay_out_*`); each old name still works
on the strategy, with a `DeprecationWarning` naming the new one
(`_base.py` installs them on `Strategy`).
"""

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["install_moved_methods"]

# Input machinery that was public on every strategy: now `strategy.placement`'s,
# where laying data out has one verb (`lay_out_*`).
_MOVED_TO_PLACEMENT = {
    "shard": "lay_out",
    "shard_steps": "lay_out_steps",
    "process_rows": "process_rows",
    "step_numbers": "step_numbers",
    "step_range": "step_range",
    "place_dataset": "lay_out_dataset",
    "place_blocks": "lay_out_blocks",
    "place_rows": "lay_out_rows",
    "exchange_rows": "exchange_rows",
    "take_rows": "take_rows",
}


def _moved_to_placement(name: str, new_name: str) -> Callable:
    def moved(self: Any, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(
            f"`strategy.{name}` is input machinery and moved to "
            f"`strategy.placement.{new_name}`; the strategy's own `{name}` will "
            "be removed in a later release. To split data over the replicas, "
            "pass it to `fit` or `strategy.experimental_distribute_dataset`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self.placement, new_name)(*args, **kwargs)

    moved.__name__ = moved.__qualname__ = name
    moved.__doc__ = f"Deprecated: use `strategy.placement.{new_name}`."
    return moved


def install_moved_methods(strategy_class: type) -> None:
    """Adds each moved method to `strategy_class` as a deprecated forward."""
    for name, new_name in _MOVED_TO_PLACEMENT.items():
        setattr(strategy_class, name, _moved_to_placement(name, new_name))
