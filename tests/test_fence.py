"""The fence holds: every private Keras, JAX and TF name keras_dist uses is listed.

Reads the syntax tree of every module of `keras_dist/` and lists the private
names it uses of other packages: names imported from private modules
(`keras.src`, `jax._src`, `tensorflow.python`), and private attributes —
read, written or called, on any object or through `self` in a subclass of a
Keras class, also by `getattr`/`hasattr`/`setattr` with a constant name —
that no keras_dist code defines. That list must be exactly what the seam
tables declare (`keras_dist/_private_api/_private.py`, `_SEAMS`,
`JAX_PRIVATE`), and the tables must hold in the installed Keras, JAX and TF.
"""

import ast
import functools
import importlib
import os
import pathlib
import subprocess
import sys

import pytest
import tensorflow  # noqa: F401  (the TF entries are checked once TF is imported)

import keras_dist
from keras_dist import _seams
from keras_dist._private_api import _private

_PACKAGE = pathlib.Path(keras_dist.__file__).parent
# The fence: the seams (top) and the private-API accessors (bottom).
FENCE = ("keras_dist/_seams/", "keras_dist/_private_api/")
_PRIVATE_MODULES = ("keras.src", "jax._src", "tensorflow.python")
_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trees() -> dict[pathlib.Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in _PACKAGE.rglob("*.py")}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(_PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _self_stores(node: ast.AST) -> set[str]:
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id in ("self", "cls")
    }


def _body_names(node: ast.AST) -> set[str]:
    """Functions, classes and variables a module or class body defines."""
    names = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _foreign_bases(path: pathlib.Path, class_def: ast.ClassDef) -> list[type]:
    """The classes of other packages the keras_dist class derives from."""
    cls = getattr(importlib.import_module(_module_name(path)), class_def.name, None)
    if not isinstance(cls, type):
        return []
    return [
        base
        for base in cls.__mro__[1:]
        if not base.__module__.startswith("keras_dist") and base is not object
    ]


def _ownership(trees):
    """(names keras_dist defines as its own attributes, foreign ones it defines).

    A private method or `self` attribute of a keras_dist class is keras_dist's
    own unless a class of another package it derives from has it too (an
    override of a private Keras hook, or a write to Keras's state through
    `self`). `self` in a function outside a class is another package's object
    (a wrapper installed on a Keras class).
    """
    own, foreign = set(), {}
    for path, tree in trees.items():
        in_class = set()
        for class_def in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = _foreign_bases(path, class_def)
            names = _self_stores(class_def) | _body_names(class_def)
            for function in ast.walk(class_def):
                in_class.add(id(function))
            for name in filter(_is_private, names):
                if any(_private._has(base, name) for base in bases):
                    foreign.setdefault(name, []).append(f"{_where(path, class_def)}")
                else:
                    own.add(name)
        own |= set(filter(_is_private, _body_names(tree)))  # Module globals.
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef) and id(function) not in in_class:
                for name in filter(_is_private, _self_stores(function)):
                    foreign.setdefault(name, []).append(_where(path, function))
    return own, foreign


def _where(path: pathlib.Path, node: ast.AST) -> str:
    return f"{path.relative_to(_PACKAGE.parent)}:{node.lineno}"


def _used(trees) -> tuple[dict[str, list[str]], dict[tuple, list[str]]]:
    """(private attribute names of other packages, private imports), with where.

    An attribute is another package's when keras_dist does not define it as
    its own (`_ownership`), or when a seam table declares it: a name both
    define (`_layout`, `_dataset`) counts as the other package's wherever it
    is read on an object other than `self`.
    """
    own, attributes = _ownership(trees)
    declared = _declared_attributes()
    imports: dict[tuple, list[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name, on_self = None, False
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                name = node.attr
                on_self = isinstance(node.value, ast.Name) and node.value.id in (
                    "self",
                    "cls",
                )
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in _ATTRIBUTE_CALLS
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _is_private(node.args[1].value)
            ):
                name = node.args[1].value
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith(_PRIVATE_MODULES):
                    for alias in node.names:
                        imports.setdefault((node.module, alias.name), []).append(
                            _where(path, node)
                        )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(_PRIVATE_MODULES):
                        imports.setdefault((alias.name, ""), []).append(
                            _where(path, node)
                        )
            if name is None or name.startswith("_keras_dist"):
                continue
            if name not in own or (name in declared and not on_self):
                attributes.setdefault(name, []).append(_where(path, node))
    return attributes, imports


@functools.cache
def _package_uses() -> tuple[dict, dict]:
    """`_used` of keras_dist's own tree, read once for the tests below."""
    return _used(_trees())


def _declared_attributes() -> set[str]:
    declared = set()
    for _, _, names in (*_private.PRIVATE_ATTRIBUTES, *_private.TF_PRIVATE_ATTRIBUTES):
        declared |= set(names)
    for _, path, _ in _seams._SEAMS:
        declared |= {part for part in path.split(".") if _is_private(part)}
    for _, path in _seams.JAX_PRIVATE:
        declared |= {part for part in path.split(".") if _is_private(part)}
    declared |= {
        name for _, name, _ in _private.TF_PRIVATE_ATTRIBUTES if _is_private(name)
    }
    return declared


def test_every_private_name_keras_dist_uses_is_in_the_tables():
    attributes, imports = _package_uses()
    unlisted = {n: w for n, w in attributes.items() if n not in _declared_attributes()}
    assert not unlisted, (
        "Private names of other packages used but not declared in "
        f"keras_dist/_private_api/_private.py: {unlisted}"
    )
    listed = set(_private.PRIVATE_IMPORTS) | {
        (module, path) for module, path, _ in _seams._SEAMS
    }
    unlisted_imports = {k: w for k, w in imports.items() if k not in listed}
    assert not unlisted_imports, f"Private imports not declared: {unlisted_imports}"


def test_no_private_name_of_another_package_is_used_outside_the_fence():
    """Keras's, JAX's, TensorFlow's and Orbax's private names are used only in
    the fence, `keras_dist/_seams/` and `keras_dist/_private_api/`: the other
    layers call the accessors of `_private_api/`."""
    attributes, imports = _package_uses()
    used = {
        **attributes,
        **{f"{module}.{name}": w for (module, name), w in imports.items()},
    }
    outside = {
        name: [w for w in where if not w.startswith(FENCE)]
        for name, where in used.items()
    }
    assert {name: where for name, where in outside.items() if where} == {}


def test_the_tables_list_nothing_the_code_no_longer_uses():
    attributes, imports = _package_uses()
    listed = {
        name
        for _, _, names in (
            *_private.PRIVATE_ATTRIBUTES,
            *_private.TF_PRIVATE_ATTRIBUTES,
        )
        for name in names
    }
    assert listed - set(attributes) == set()
    assert set(_private.PRIVATE_IMPORTS) - set(imports) == set()


def test_the_tables_hold_in_the_installed_releases():
    assert _private.check() == []
    assert _private.check("orbax") == []  # Checked at Orbax's first use.
    assert _private.check("tensorflow") == []
    assert _private.check_signatures(_seams._originals) == []
    assert set(_private.SIGNATURES) == {
        path for _, path, wrap in _seams._SEAMS if wrap is not None
    }


def test_a_moved_private_attribute_fails_loudly(monkeypatch):
    table = (
        *_private.PRIVATE_ATTRIBUTES,
        ("keras.src.trainers.trainer", "Trainer", ("_no_such_state",)),
    )
    monkeypatch.setattr(_private, "PRIVATE_ATTRIBUTES", table)
    assert _private.check() == ["keras.src.trainers.trainer.Trainer._no_such_state"]
    with pytest.raises(ImportError, match=r"no longer has \[.*Trainer\._no_such_state"):
        _seams.seams()


def test_a_changed_signature_fails_loudly(monkeypatch):
    def _make_function(self, step_function):  # A release dropped an argument.
        return step_function

    originals = {
        **_seams._originals,
        "JAXTrainer._make_function": _make_function,
    }
    (changed,) = _private.check_signatures(originals)
    assert changed.startswith("JAXTrainer._make_function: written for ('self', ")
    assert "found ('self', 'step_function')" in changed


def test_the_fence_finds_a_new_private_read(tmp_path, monkeypatch):
    """The lister is not blind: an unlisted read in a module is reported."""
    module = _PACKAGE / "_fence_probe.py"
    trees = _trees()
    trees[module] = ast.parse("def f(model):\n    return model._compile_metrics\n")
    attributes, _ = _used(trees)
    assert attributes["_compile_metrics"] == ["keras_dist/_fence_probe.py:2"]


def test_the_tables_hold_at_most_80_names():
    """The private surface: each name a place the next release can break."""
    private = _seams.private_seams()
    total = (
        len(private)
        + len(_private.PRIVATE_IMPORTS)
        + sum(len(names) for _, _, names in _private.PRIVATE_ATTRIBUTES)
        + sum(len(names) or 1 for _, _, names in _private.TF_PRIVATE_ATTRIBUTES)
        + len(_seams.JAX_PRIVATE)
    )
    assert total <= 80
    page = (_PACKAGE.parent / "docs" / "design.md").read_text()
    assert f"{total} in all" in " ".join(page.split())


def test_the_design_page_gives_the_counts_of_the_tables():
    page = (_PACKAGE.parent / "docs" / "design.md").read_text()
    text = " ".join(page.split())
    private = _seams.private_seams()
    wrapped = sum(1 for _, _, wrap in private if wrap is not None)
    read = sum(1 for _, _, wrap in private if wrap is None)
    attributes = sum(len(names) for _, _, names in _private.PRIVATE_ATTRIBUTES)
    tf_names = sum(len(names) or 1 for _, _, names in _private.TF_PRIVATE_ATTRIBUTES)
    for phrase in (
        f"{wrapped} wrapped functions and {read} read by name",
        f"{len(_private.PRIVATE_IMPORTS)} names imported from private modules",
        f"{attributes} private attributes of Keras and JAX objects and "
        f"{tf_names} of tf.data's",
        f"{len(_seams.JAX_PRIVATE)} private JAX names",
    ):
        assert phrase in text, phrase


def _package_of(path: pathlib.Path) -> str:
    """The layer folder of a module (`strategies`, `data`, ...), or the module."""
    parts = path.relative_to(_PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _private_definitions(trees) -> dict[str, set[str]]:
    """Each private name keras_dist defines, and the packages that define it."""
    where: dict[str, set[str]] = {}
    for path, tree in trees.items():
        names = set(filter(_is_private, _body_names(tree)))
        for class_def in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names |= set(filter(_is_private, _self_stores(class_def)))
            names |= set(filter(_is_private, _body_names(class_def)))
        for name in names:
            where.setdefault(name, set()).add(_package_of(path))
    return where


def _cross_package_reads(trees) -> list[str]:
    defined = _private_definitions(trees)
    foreign = _declared_attributes()
    reads = []
    for path, tree in trees.items():
        package = _package_of(path)
        # Names bound to other libraries' modules (`os._exit` is os's API).
        libraries = {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if not alias.name.startswith("keras_dist")
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and (
                node.value.id in ("self", "cls") or node.value.id in libraries
            ):
                continue
            owners = defined.get(node.attr)
            if owners and package not in owners and node.attr not in foreign:
                reads.append(f"{_where(path, node)}: {ast.unparse(node)}")
    return reads


def test_no_module_reads_a_private_attribute_of_another_packages_object():
    """Seams and helpers talk to a strategy through its public members."""
    assert _cross_package_reads(_trees()) == []


def test_a_seam_reading_a_strategys_private_attribute_is_found():
    trees = _trees()
    probe = _PACKAGE / "_seams" / "_probe.py"
    trees[probe] = ast.parse("def f(strategy):\n    return strategy._state_layout\n")
    assert _cross_package_reads(trees) == [
        "keras_dist/_seams/_probe.py:2: strategy._state_layout"
    ]


def test_orbax_is_imported_and_checked_at_its_first_use_not_at_import():
    code = (
        "import sys, keras_dist; print('orbax' in sys.modules); "
        "from keras_dist._checkpoint import orbax_store; orbax_store._ocp(); "
        "print('orbax' in sys.modules)"
    )
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


def test_a_moved_orbax_name_fails_loudly_at_its_first_use(monkeypatch):
    from keras_dist._checkpoint import orbax_store

    table = (
        *_private.PRIVATE_ATTRIBUTES,
        ("orbax.checkpoint.experimental.v1._src.training.checkpointer",
         "Checkpointer", ("_no_such_manager",)),
    )  # fmt: skip
    monkeypatch.setattr(_private, "PRIVATE_ATTRIBUTES", table)
    orbax_store._ocp.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"no longer has \[.*_no_such_manager"):
            orbax_store._ocp()
    finally:
        orbax_store._ocp.cache_clear()
