"""Boundaries read from the product's source: which modules may import the job queue's library,
and where private names of dependencies may appear."""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = [
    REPO / "shared/src/fleet_shared",
    REPO / "gateway/src/fleet_gateway",
    REPO / "worker/src/fleet_worker",
    REPO / "cli/src/fleet_cli",
]
JOB_QUEUE_MODULES = {"fleet_shared/jobs.py", "fleet_shared/jobs_worker.py"}


def product_modules() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            yield str(path.relative_to(package.parent)), ast.parse(path.read_text(), str(path))


def imported_modules(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_only_the_job_queue_modules_import_arq() -> None:
    importers = {
        name
        for name, tree in product_modules()
        if any(module == "arq" or module.startswith("arq.") for module in imported_modules(tree))
    }
    assert importers == JOB_QUEUE_MODULES


def test_the_scan_sees_an_arq_import() -> None:
    """The scan itself: an import of arq in any form is found."""
    for source in ("import arq", "from arq.jobs import Job", "import arq.connections as c"):
        assert any(m == "arq" or m.startswith("arq.") for m in imported_modules(ast.parse(source)))


GUARDED = ("dspy", "litestar", "arq", "granian")  # dependencies whose private names are fenced


def is_private(name: str) -> bool:
    """`_x` or `__x` (name-mangled); not a dunder such as `__init__`."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def guarded(module: str) -> bool:
    return module.split(".", maxsplit=1)[0] in GUARDED


def private_uses(tree: ast.Module) -> Iterator[str]:
    """Each use of a private name of CPython's underscore modules or of a guarded dependency."""
    bound: set[str] = set()  # local names bound to a guarded module or to something from one
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_private(alias.name.split(".")[0]):
                    yield f"import {alias.name}"
                if guarded(alias.name):
                    bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if is_private(node.module.split(".")[0]):
                yield f"from {node.module} import"
            if guarded(node.module):
                if any(is_private(part) for part in node.module.split(".")):
                    yield f"from {node.module} import"
                for alias in node.names:
                    if is_private(alias.name):
                        yield f"from {node.module} import {alias.name}"
                    bound.add(alias.asname or alias.name)
    if not bound:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            isinstance(base, ast.Name | ast.Attribute) and ast.unparse(base).split(".")[0] in bound
            for base in node.bases
        ):  # a subclass of a dependency's class: its private methods and attributes are the dependency's
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef) and is_private(inner.name):
                    yield f"def {node.name}.{inner.name}"
                elif isinstance(inner, ast.Attribute) and is_private(inner.attr):
                    yield f"{ast.unparse(inner)}"
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if (isinstance(root, ast.Name) and root.id in bound) or (
                isinstance(root, ast.Call) and ast.unparse(root.func) == "super"
            ):
                yield ast.unparse(node)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and is_private(node.value)
            and node.value.isidentifier()  # a private name spelt as a string (getattr, a logger)
        ):
            yield repr(node.value)


# The REPL driver runs alone in the jail (one staged file, no fleet package beside it), so its
# start-up tricks, the C halves of stdlib modules, stay in it: one place (ADR 0035).
REPL_DRIVER = "fleet_worker/sandbox/repl_main.py"


def c_half_import(use: str) -> bool:
    return use.startswith(("import _", "from _"))


def test_private_names_of_dependencies_appear_only_in_compat_modules() -> None:
    found = {
        name: sorted(
            use for use in set(private_uses(tree)) if not (name == REPL_DRIVER and c_half_import(use))
        )
        for name, tree in product_modules()
        if not name.endswith("_compat.py")
    }
    assert {name: uses for name, uses in found.items() if uses} == {}


def test_the_scan_sees_each_kind_of_private_use() -> None:
    cases = {
        "import _json": "import _json",
        "from _thread import allocate_lock": "from _thread import",
        "from granian._granian import x": "from granian._granian import",
        "from arq.worker import _private": "from arq.worker import _private",
        "import dspy\nclass R(dspy.RLM):\n    def _build(self):\n        return self._x": "def R._build",
        "import dspy\nclass R(dspy.RLM):\n    def f(self):\n        return super()._y()": "super()._y",
        "from litestar import Stream\nStream._stream": "Stream._stream",
        "import granian\nNAME = '_granian'": "'_granian'",
    }
    for source, expected in cases.items():
        assert expected in set(private_uses(ast.parse(source))), source
    assert not set(private_uses(ast.parse("import os\nos._exit(0)\nclass A:\n    def _b(self): self._c = 1")))


def test_no_product_function_exists_only_for_tests() -> None:
    """A top-level function or class of the product that no product module uses, but a test
    does, is a test helper living in the product: it belongs under tests/."""
    sources = {path: path.read_text() for package in PACKAGES for path in package.rglob("*.py")}
    product_words = Counter(re.findall(r"\w+", "\n".join(sources.values())))
    test_files = (path for path in (REPO / "tests").rglob("*.py") if "node_modules" not in path.parts)
    test_words = set(re.findall(r"\w+", "\n".join(path.read_text() for path in test_files)))
    only_for_tests = [
        f"{path.relative_to(REPO)}: {node.name}"
        for path, text in sources.items()
        for node in ast.parse(text).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and product_words[node.name] == 1  # its definition, and no use
        and node.name in test_words
    ]
    assert only_for_tests == []
