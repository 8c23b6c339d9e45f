"""A Python started with this folder on PYTHONPATH and KD_AS_INSTALLED set
imports only what `pip install "keras-dist[EXTRAS]"` would have installed.

KD_AS_INSTALLED: the extras, comma-separated ("" for none);
KD_INSTALLED_ALONE: distributions installed beside it without their
dependencies (e.g. "keras-hub", as README installs it with --no-deps).
Every other distribution of this environment (the test extra's TensorFlow,
TFDS, optax, ...) is refused at import and hidden from importlib.metadata,
as on a machine where it is not installed: the docs' examples run in CI on
exactly the install their page names (tests/test_docs.py).
"""

import importlib.abc
import importlib.metadata
import os
import re
import sys


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def installed(
    extras: list[str], also: list[str] = (), alone: list[str] = ()
) -> set[str]:
    """The distributions `pip install "keras-dist[extras]" *also` pulls in,
    and `alone` (installed with `--no-deps`), by normalized name."""
    from packaging.requirements import Requirement

    wanted = [("keras-dist", set(extras))] + [(d, set()) for d in also]
    seen: set = set()
    while wanted:
        dist, dist_extras = wanted.pop()
        key = (_name(dist), frozenset(dist_extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            # Installed under another name (CI's newest stack: keras-nightly
            # for keras), or an optional dependency this environment lacks.
            module = _name(dist).replace("-", "_")
            others = importlib.metadata.packages_distributions().get(module, [])
            wanted += [(other, dist_extras) for other in others]
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or any(
                req.marker.evaluate({"extra": e}) for e in [*dist_extras, ""]
            ):
                wanted.append((req.name, set(req.extras)))
    return {dist for dist, _ in seen} | {_name(d) for d in _as_installed(alone)}


def _as_installed(dists: list[str]) -> list[str]:
    """`dists`, each by the name it is installed under: keras-hub is
    keras-hub-nightly on CI's newest stack."""
    found = []
    for dist in dists:
        try:
            importlib.metadata.distribution(dist)
            found.append(dist)
        except importlib.metadata.PackageNotFoundError:
            module = _name(dist).replace("-", "_")
            found += importlib.metadata.packages_distributions().get(module, [dist])
    return found


class _Installed(importlib.abc.MetaPathFinder):
    """One of Python's finders, that finds no module of `refused` and no
    distribution outside `installed`: `import` raises Python's own
    ModuleNotFoundError, `importlib.util.find_spec` returns None and
    `importlib.metadata.version` raises PackageNotFoundError, as for a
    package that is not installed."""

    def __init__(self, finder, refused: set[str], installed: set[str]) -> None:
        self.finder, self.refused, self.installed = finder, refused, installed

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.finder, "find_distributions", None)
        for dist in find(*args, **kwargs) if find else []:
            if _name(dist.metadata["Name"] or "") in self.installed:
                yield dist

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.refused:
            return None
        find_spec = getattr(self.finder, "find_spec", None)
        return None if find_spec is None else find_spec(name, path, target)

    def invalidate_caches(self) -> None:
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


def _install() -> None:
    extras = [e for e in os.environ["KD_AS_INSTALLED"].split(",") if e]
    alone = [d for d in os.environ.get("KD_INSTALLED_ALONE", "").split(",") if d]
    kept = installed(extras, alone=alone)
    refused = {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not any(_name(d) in kept for d in dists)
        and module not in sys.stdlib_module_names
    }
    sys.meta_path[:] = [_Installed(finder, refused, kept) for finder in sys.meta_path]


if "KD_AS_INSTALLED" in os.environ:
    _install()
