"""Orbax's private names keras_dist uses, behind public names.

Orbax asks JAX's preemption service at every save (a collective with
several processes) and has no public switch; the v1 `Checkpointer` keeps
its v0 manager, which holds that query, in `_manager` (listed in
`_private.PRIVATE_ATTRIBUTES`). Imports nothing of keras_dist.
"""

__all__ = ["without_preemption_queries"]


def _never_preempted(step: int) -> bool:
    return False


def without_preemption_queries(manager) -> None:
    """`manager` (Orbax's `CheckpointManager`, or the v1 `Checkpointer`
    around one) no longer asks JAX's preemption service at each save."""
    inner = getattr(manager, "_manager", manager)  # v1 keeps its v0 manager.
    if not hasattr(inner, "reached_preemption"):
        import orbax.checkpoint

        raise RuntimeError(
            "keras_dist: Orbax's CheckpointManager has no `reached_preemption` "
            f"in orbax-checkpoint {orbax.checkpoint.__version__}; keras_dist "
            "is tested with 0.11 and 0.12: install one of those."
        )
    inner.reached_preemption = _never_preempted
