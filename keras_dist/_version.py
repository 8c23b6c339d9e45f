"""The package version (one place).

Semantic: a new minor (0.x) when a public API or a checkpoint format
changes (`_checkpoint.orbax_store.FORMAT`), a new patch for fixes alone;
CHANGELOG.md says what each version changed.
"""

__version__ = "0.2.0"
