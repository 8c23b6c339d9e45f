"""Which strategy a variable, or a model, belongs to."""

import weakref
from typing import Any

from keras_dist._private_api import _access
from keras_dist.strategies.state._parts import StrategyParts

__all__ = [
    "is_strategy",
    "model_variables",
    "newest_strategy_on",
    "register",
    "strategy_of_model",
    "strategy_of_variable",
]

# DeviceMesh -> Strategy, so a variable's layout leads back to its strategy.
_STRATEGY_OF_MESH: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def register(strategy: StrategyParts) -> None:
    _STRATEGY_OF_MESH[strategy.device_mesh] = strategy


def is_strategy(distribution: Any) -> bool:
    """Whether `distribution` is a keras_dist strategy (every one registers)."""
    mesh = getattr(distribution, "device_mesh", None)
    return mesh is not None and _STRATEGY_OF_MESH.get(mesh) is distribution


def newest_strategy_on(mesh: Any):
    """The newest live strategy over `mesh` (equal meshes are one in JAX), or None."""
    return next(
        (
            s
            for s in reversed(list(_STRATEGY_OF_MESH.values()))
            if s.mesh is mesh or s.mesh == mesh
        ),
        None,
    )


def strategy_of_variable(variable):
    """The keras_dist strategy a Keras variable was created under, if any."""
    mesh = getattr(_access.assigned_layout(variable), "device_mesh", None)
    return None if mesh is None else _STRATEGY_OF_MESH.get(mesh)


def model_variables(model) -> list:
    """Every variable a training loop touches: model, optimizer, metrics."""
    groups = [model.trainable_variables, model.non_trainable_variables]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "variables"):
        groups.append(optimizer.variables)
    groups.append(getattr(model, "metrics_variables", []))
    seen, out = set(), []
    for group in groups:
        for v in group:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def strategy_of_model(model):
    """The strategy the model (or its optimizer or metrics) was built under."""
    for v in model_variables(model):
        strategy = strategy_of_variable(v)
        if strategy is not None:
            return strategy
    return None
