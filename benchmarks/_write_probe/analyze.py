"""Where a run's step time went around its saves (`KD_STEPS_LOG` files).

    python benchmarks/_write_probe/analyze.py STEPS.json[.gz] EVERY

Prints the median step, the time above the median in all, and for each
save the time above the median in the windows of steps after it.
"""

import gzip
import itertools
import json
import statistics
import sys

WINDOWS = ((1, 10), (10, 100), (100, 300), (300, 600))


def main() -> None:
    path, every = sys.argv[1], int(sys.argv[2])
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        times = json.load(f)["steps"]
    steps = [b - a for a, b in itertools.pairwise(times)]
    median = statistics.median(steps)
    excess = sum(steps) - median * len(steps)
    print(
        f"{len(times)} steps: median {1000 * median:.3f} ms, "
        f"above the median {1000 * excess:.0f} ms in all"
    )
    for save in range(every, len(steps), every):
        parts = []
        for lo, hi in WINDOWS:
            window = steps[save - 1 + lo : save - 1 + hi]
            above = sum(window) - median * len(window)
            parts.append(f"+{lo}..+{hi}: {1000 * above:.0f} ms")
        print(f"after the save at step {save}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
