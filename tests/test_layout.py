"""The code is laid out as `docs/design.md` says ("How the code is laid out").

That section's table gives every room of the package (each folder, each
top-level module) a floor. These tests read the tree and the import
statements of `keras_dist/` and `keras_dist_run/` (their syntax trees, every
`import` at any depth) against it: a folder added or removed without its
line fails, and so does an import that does not run down a floor. A
folder's `__init__.py` only hands names on (the package's face), so its
imports are not counted; any other module's are.
"""

import ast
import pathlib

import pytest

from tests._layout import floors, room_of

pytestmark = pytest.mark.source_checks

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("keras_dist", "keras_dist_run")
# Imports that run back up the table, each with its reason (at most one).
UPWARD: dict[tuple[str, str], str] = {}


def _rooms_in_tree() -> set[str]:
    """Every folder with Python modules, and every top-level module."""
    rooms = set()
    for package in PACKAGES:
        base = ROOT / package
        rooms.add(f"{package}/")
        for path in base.rglob("*.py"):
            rel = path.relative_to(ROOT)
            if len(rel.parts) == 2 and package == "keras_dist":
                rooms.add(str(rel))
            if len(rel.parts) > 2:
                rooms.add("/".join(rel.parts[:-1]) + "/")
    rooms.discard("keras_dist/")  # Its modules are rooms one by one.
    if "keras_dist_run/" in rooms:  # One room, whatever its files.
        rooms = {r for r in rooms if not r.startswith("keras_dist_run/")}
        rooms.add("keras_dist_run/")
    return rooms


def _module_path(name: str) -> pathlib.PurePath | None:
    """The file (or package) a dotted module name of this tree is."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    for end in range(len(parts), 0, -1):
        stem = ROOT.joinpath(*parts[:end])
        if stem.is_dir():
            return (stem / "__init__.py").relative_to(ROOT)
        if stem.with_suffix(".py").is_file():
            return stem.with_suffix(".py").relative_to(ROOT)
    return None


def _imports(path: pathlib.Path) -> set[pathlib.PurePath]:
    """The modules of this tree that `path` imports (`from pkg import mod`
    counts as importing `pkg.mod` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            target = _module_path(name)
            if target is not None:
                found.add(target)
    return found


def _arrows(table: dict[str, int]) -> set[tuple[str, str, str]]:
    """(from room, to room, file) for every import between two rooms."""
    arrows = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT)
            face = path.name == "__init__.py" and str(rel) not in table
            if package == "keras_dist" and face:
                continue  # A folder's face: it hands names on.
            source = room_of(rel, table)
            for target in _imports(path):
                room = room_of(target, table)
                if room != source:
                    arrows.add((source, room, str(rel)))
    return arrows


def test_every_folder_and_module_has_its_line():
    table = floors()
    in_tree = _rooms_in_tree()
    assert sorted(in_tree - set(table)) == [], "rooms without a line in design.md"
    assert sorted(set(table) - in_tree) == [], "lines of rooms the tree lacks"


def test_every_import_runs_down_a_floor():
    table = floors()
    wrong = sorted(
        f"{file}: {source} (floor {table[source]}) imports {target} "
        f"(floor {table[target]})"
        for source, target, file in _arrows(table)
        if table[target] >= table[source] and (source, target) not in UPWARD
    )
    assert wrong == []
    assert len(UPWARD) <= 1


def test_a_room_that_imports_upward_is_found():
    table = dict(floors())
    # The cluster layer imported by the host input path is fine; swapped, not.
    table["keras_dist/cluster/"], table["keras_dist/data/host/"] = (
        table["keras_dist/data/host/"],
        table["keras_dist/cluster/"],
    )
    assert any(
        source == "keras_dist/data/host/" and target == "keras_dist/cluster/"
        for source, target, _ in _arrows(table)
        if table[target] >= table[source]
    )


def test_the_private_api_and_the_launcher_import_nothing_of_keras_dist():
    table = floors()
    for room in ("keras_dist/_private_api/", "keras_dist_run/"):
        assert [a for a in _arrows(table) if a[0] == room] == [], room
