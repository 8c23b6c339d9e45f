"""A long-lived process that runs worker scripts one after another (smoke runs).

`_runs.run_worker(..., shared=True)` with sharing on (a benchmark's
`--shared-process`) sends each run here instead of starting a fresh Python:
one JSON line on stdin, `{"script": path, "args": [...]}`; the script runs
as `__main__` with those `sys.argv`, its output captured; one line back on
stdout, `HOST {"returncode": ..., "stdout": ..., "stderr": ...}`. The
imports (JAX, Keras, keras_dist) and JAX's caches carry over from one run to
the next: the same code and rows, no timings to quote.
"""

import contextlib
import io
import json
import runpy
import sys
import traceback


def _run(script: str, args: list) -> dict:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv = [script, *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:  # A worker's `sys.exit(reason)`.
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
            code = stop.code if isinstance(stop.code, int) else int(bool(stop.code))
        except BaseException:  # A crashed run, reported as a fresh process's.
            traceback.print_exc()
            code = 1
    _reset()
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _reset() -> None:
    """Keras's global state back to a fresh process's, for the next run."""
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        result = _run(job["script"], job["args"])
        sys.__stdout__.write("HOST " + json.dumps(result) + "\n")
        sys.__stdout__.flush()


if __name__ == "__main__":
    main()
