"""The original Keras functions, saved by `install()` before it wraps them."""

from typing import Any

originals: dict[str, Any] = {}
