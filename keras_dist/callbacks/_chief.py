"""Who writes: the chief (process 0) only."""

import jax

__all__ = ["is_chief"]


def is_chief() -> bool:
    """True in the process that writes files and prints (process 0)."""
    return jax.process_index() == 0
