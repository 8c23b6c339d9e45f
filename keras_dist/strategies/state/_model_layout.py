"""`ModelParallelStateLayout`: variables split over a `("batch", "model")` mesh.

On a 2-D mesh each variable gets a spec with one entry per dimension
(`None`, `"model"`, `"batch"`), from one of two sources:

- **A `keras.distribution.LayoutMap`** (keras-hub's `get_layout_map`, or
  the user's): Keras's rules and matching (`LayoutMap[path]`: an exact key,
  else the one regex that `re.fullmatch`es the path; several: Keras's
  error). A variable no rule matches is replicated, as in Keras.
- **Automatic**, correct for any model and Megatron-like for transformers:
  - a kernel of 3 or more dimensions (an attention projection of
    `EinsumDense`: `(hidden, heads, head_dim)`, `(heads, hidden, head_dim)`,
    `(heads, head_dim, hidden)`) is split along its heads: the first
    dimension that is not its largest, when the model axis divides it (so
    each device computes whole heads, and only the output projection's
    result is summed); else along its largest divisible dimension;
  - a 2-D kernel or embedding is split along its largest divisible
    dimension: the wide side of a feed-forward pair (`(hidden, ffn)` by
    columns, `(ffn, hidden)` by rows: one sum per pair, as Megatron-LM
    splits it) and the vocabulary of an embedding;
  - vectors (biases, norms) and scalars are replicated.

Where the model axis does not divide a dimension a rule puts on it (one
key/value head over 4 devices; Keras raises there), the dimension stays
whole and one warning lists those variables when the strategy's scope is
left. With `shard_variables=True`, the largest dimension the layout leaves
whole and `"batch"` divides is split over `"batch"` too (FSDP); with
`shard_optimizer_state=True`, optimizer slots get that split and their
weights do not (ZeRO-1). A variable of at least `LARGE_BYTES` that no rule
of a layout map matches stays whole on every device: listed in the same
warning and in `memory_report`, an error with `strict=True`.
"""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_dist.strategies.devices._mesh import BATCH_AXIS, MODEL_AXIS
from keras_dist.strategies.state._sharding import ShardPlan
from keras_dist.strategies.state._state_layout import ShardedStateLayout

__all__ = [
    "LARGE_BYTES",
    "LayoutPlan",
    "ModelParallelStateLayout",
    "sharded_state",
]

# A variable this large that no rule of a layout map matches is worth a
# warning: whole on every device, it is what runs a model out of memory.
LARGE_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """One variable's spec on the 2-D mesh, and why.

    Attributes:
        axes: one mesh axis name (or None, or a tuple of names) per dimension.
        reason: how the spec was chosen (`memory_report` shows it).
    """

    axes: tuple
    reason: str = ""


class ModelParallelStateLayout(ShardedStateLayout):
    """Variables laid out on a `("batch", "model")` mesh.

    Args:
        device_mesh: the strategy's 2-D `keras.distribution.DeviceMesh`.
        owner: the strategy's name.
        layout_map: a `keras.distribution.LayoutMap`, or None: automatic.
        shard_variables: also split over `"batch"` what the layout leaves
            whole (FSDP).
        shard_optimizer_state: split optimizer slots so (ZeRO-1).
        strict: a large variable no rule matches is an error, not a warning.
    """

    def __init__(
        self,
        device_mesh: keras.distribution.DeviceMesh,
        owner: str,
        *,
        layout_map: "keras.distribution.LayoutMap | None",
        shard_variables: bool = False,
        shard_optimizer_state: bool = False,
        strict: bool = False,
    ):
        super().__init__(
            device_mesh,
            owner,
            shard_variables=shard_variables,
            shard_optimizer_state=shard_optimizer_state,
        )
        self.layout_map = layout_map
        self.strict = strict
        self.sizes = dict(
            zip(device_mesh.axis_names, device_mesh.devices.shape, strict=True)
        )
        # Found while variables are made; `take_warnings` reports them once.
        self.undivided: dict[str, str] = {}
        self.unmatched: dict[str, int] = {}
        self._plans: dict[str, LayoutPlan] = {}

    @property
    def model_parallel(self) -> int:
        return int(self.sizes[MODEL_AXIS])

    @property
    def splits_state(self) -> bool:
        return True

    def variable_layout(self, variable: Any) -> keras.distribution.TensorLayout:
        plan = self.plan(variable.path, tuple(variable.shape), variable.dtype)
        if self.shard_variables:
            plan = self._with_batch(plan, tuple(variable.shape))
        self._plans[variable.path] = plan
        return keras.distribution.TensorLayout(plan.axes, self.device_mesh)

    def slot_layout(self, variable: Any) -> "keras.distribution.TensorLayout | None":
        if not self.shard_optimizer_state or self.shard_variables:
            return None  # Slots follow their variable.
        shape = tuple(variable.shape)
        plan = self._with_batch(self.plan(variable.path, shape, variable.dtype), shape)
        return keras.distribution.TensorLayout(plan.axes, self.device_mesh)

    @property
    def slots_need_whole_gradients(self) -> bool:
        return False  # XLA lays each gradient out as its slot needs it.

    def shard_plan(self, shape: tuple[int, ...], dtype: Any) -> ShardPlan:
        """The 1-D plan's answer (`memory_report` asks `reason` instead)."""
        return ShardPlan(axis=None, reason="laid out on the 2-D mesh")

    def reason(self, path: str, shape: tuple[int, ...], dtype: Any) -> str:
        """How the variable at `path` was laid out."""
        plan = self._plans.get(path)
        if plan is None:  # Made with a layout of its own: an optimizer slot.
            return "laid out as its weight"
        return plan.reason

    def plan(self, path: str, shape: tuple[int, ...], dtype: Any) -> LayoutPlan:
        """The spec of a variable over the mesh, before FSDP."""
        if self.layout_map is not None:
            return self._by_rule(self.layout_map, path, shape, dtype)
        return _automatic(shape, self.model_parallel)

    def _by_rule(
        self,
        layout_map: "keras.distribution.LayoutMap",
        path: str,
        shape: tuple,
        dtype: Any,
    ) -> LayoutPlan:
        rule = layout_map[path]
        if rule is None:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if nbytes >= LARGE_BYTES:
                if self.strict:
                    raise ValueError(
                        f"No rule of `layout_map` matches the variable {path!r} "
                        f"of shape {shape} ({nbytes / 2**20:.1f} MiB), so every "
                        "device would hold it whole. Add a rule for it, or pass "
                        "`strict=False` to keep it whole with a warning."
                    )
                self.unmatched[path] = nbytes
            return LayoutPlan((None,) * len(shape), "no rule of the layout map")
        axes = tuple(getattr(rule, "axes", rule))
        if len(axes) != len(shape):
            raise ValueError(
                f"The `layout_map` rule for {path!r} has {len(axes)} axes {axes} "
                f"for a variable of shape {shape}. Give one mesh axis (or None) "
                "per dimension."
            )
        kept, whole = [], []
        for dim, axis in zip(shape, axes, strict=True):
            parts = self._parts(axis, path)
            if parts > 1 and dim % parts:
                whole.append(f"{dim} over {axis!r}")
                axis = None
            kept.append(axis)
        if whole:
            self.undivided[path] = ", ".join(whole)
            return LayoutPlan(
                tuple(kept), f"layout map; kept whole: {', '.join(whole)}"
            )
        return LayoutPlan(tuple(kept), "layout map")

    def _parts(self, axis: Any, path: str) -> int:
        names = axis if isinstance(axis, tuple) else (axis,)
        parts = 1
        for name in names:
            if name is None:
                continue
            if name not in self.sizes:
                raise ValueError(
                    f"The `layout_map` rule for {path!r} names the mesh axis "
                    f"{name!r}; the strategy's mesh has {tuple(self.sizes)}."
                )
            parts *= int(self.sizes[name])
        return parts

    def _with_batch(self, plan: LayoutPlan, shape: tuple) -> LayoutPlan:
        """`plan` with FSDP: the largest whole dimension split over `"batch"`."""
        batch = int(self.sizes[BATCH_AXIS])
        used = {
            name
            for axis in plan.axes
            for name in (axis if isinstance(axis, tuple) else (axis,))
        }
        if batch < 2 or BATCH_AXIS in used:
            return plan
        free = [
            i for i, d in enumerate(shape) if plan.axes[i] is None and d % batch == 0
        ]
        if not free:
            return plan
        axis = max(free, key=lambda i: (shape[i], -i))
        axes = list(plan.axes)
        axes[axis] = BATCH_AXIS
        return LayoutPlan(tuple(axes), f"{plan.reason}; FSDP over {BATCH_AXIS!r}")

    def take_warnings(self, stacklevel: int = 2) -> None:
        """Warns once about the variables found since the last call."""
        lines = []
        if self.undivided:
            lines.append(
                "The model axis does not divide these dimensions, so they stay "
                "whole (Keras's ModelParallel raises here): "
                + "; ".join(f"{p} ({why})" for p, why in self.undivided.items())
                + "."
            )
        if self.unmatched:
            lines.append(
                "No rule of `layout_map` matches these large variables, so every "
                "device holds them whole: "
                + "; ".join(
                    f"{p} ({n / 2**20:.1f} MiB)" for p, n in self.unmatched.items()
                )
                + ". Add rules for them, or pass `strict=True` to make this an error."
            )
        self.undivided, self.unmatched = {}, {}
        if lines:
            warnings.warn(" ".join(lines), UserWarning, stacklevel=stacklevel + 1)


def _automatic(shape: tuple, parts: int) -> LayoutPlan:
    shape = tuple(int(d) for d in shape)
    whole: tuple[str | None, ...] = (None,) * len(shape)
    if len(shape) < 2:
        return LayoutPlan(whole, "automatic: vectors and scalars stay whole")
    if len(shape) >= 3:
        largest = max(range(len(shape)), key=lambda i: (shape[i], -i))
        heads = next(i for i in range(len(shape)) if i != largest)
        if shape[heads] % parts == 0:
            axes = list(whole)
            axes[heads] = MODEL_AXIS
            return LayoutPlan(tuple(axes), f"automatic: heads (axis {heads})")
    divisible = [i for i, d in enumerate(shape) if d % parts == 0]
    if not divisible:
        return LayoutPlan(whole, f"automatic: no dimension divisible by {parts}")
    axis = max(divisible, key=lambda i: (shape[i], -i))
    axes = list(whole)
    axes[axis] = MODEL_AXIS
    return LayoutPlan(tuple(axes), f"automatic: largest divisible (axis {axis})")


def sharded_state(
    *,
    shard_variables: bool,
    shard_optimizer_state: bool,
    strict: bool = False,
) -> Callable[..., ShardedStateLayout]:
    """The state layout of the `shard_variables` / `shard_optimizer_state` options.

    Checked at once, before a strategy joins a cluster or builds its mesh.
    The layout made is `ModelParallelStateLayout` on a 2-D mesh, else
    `ShardedStateLayout`.

    Raises:
        TypeError: if an option is not a bool.
    """
    for name, value in (
        ("shard_variables", shard_variables),
        ("shard_optimizer_state", shard_optimizer_state),
        ("strict", strict),
    ):
        if not isinstance(value, bool):
            raise TypeError(
                f"`{name}` must be True or False. Received: {name}={value!r}."
            )

    def make(device_mesh, owner, layout_map=None):
        if len(device_mesh.axis_names) > 1:
            return ModelParallelStateLayout(
                device_mesh,
                owner,
                layout_map=layout_map,
                shard_variables=shard_variables,
                shard_optimizer_state=shard_optimizer_state,
                strict=strict,
            )
        return ShardedStateLayout(
            device_mesh,
            owner,
            shard_variables=shard_variables,
            shard_optimizer_state=shard_optimizer_state,
        )

    return make
