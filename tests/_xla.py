"""The XLA flags of the tests' processes, the pytest workers and the processes
the tests start alike (not the docs', notebooks' and benchmarks' runs, which
run as a user runs them, with XLA's defaults).

XLA:CPU compiles the tests' programs with its loop emitters, not its newer
MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`), where the
installed XLA still has them: JAX 0.10 (CI's stage 1); JAX 0.12 removed the
flag, and XLA aborts on a flag it does not know, so stage 2 compiles with the
defaults. On 2 cores compiling is most of the suite's CPU time, and the MLIR
emitters most of compiling: `tests/test_fidelity.py` from a cold compilation
cache used 67-69 CPU-seconds with the flag against 98-101 without (two
interleaved pairs, 2026-12-06). A test compares two programs XLA compiled with the
same flags (distributed and one device, keras_dist and plain Keras, a run and
its restart), so each comparison stands; the accelerators users train on
compile with other back ends altogether. `KD_TEST_XLA_DEFAULTS=1` runs the
tests with XLA's defaults.
"""

import os
from importlib import metadata

_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _codegen() -> str:
    if os.environ.get("KD_TEST_XLA_DEFAULTS") == "1":
        return ""
    version = tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2])
    return _EMITTERS if version < (0, 11) else ""


# The flags, less the device count, every test process compiles with.
CODEGEN = _codegen()


def xla_flags(devices: int | None = None) -> str:
    """`XLA_FLAGS` for a process the tests start: `CODEGEN`, and `devices`
    virtual CPU devices (None: the count is set elsewhere, e.g. by the
    launcher's `--devices-per-process`)."""
    flags = [CODEGEN] if CODEGEN else []
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
