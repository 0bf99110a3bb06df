"""The code's layout keeps the house rules: no module over 600 lines and no function over
50 (../shared/STYLE.md: a reader takes in a room, and a function, at once), and no branch
on the database's dialect outside the backend that owns its SQL (each backend's package
does its own way by overriding a method, never by an ``if`` elsewhere), and no context
variable in the store or the server: a transaction is an object passed where it is meant
(:meth:`gpufleet.store.api.Store.transaction`), never state a call picks up unseen."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gpufleet"

MOST_MODULE_LINES = 600
MOST_FUNCTION_LINES = 50
# Applied migrations are history, never edited; vendored code is someone else's.
NOT_OURS = ("src/gpufleet/store/migrations/", "/vendor/")
# The backends' packages: the only rooms that may know which database they are on (with
# the migrations, which are not read at all).
BACKENDS = ("src/gpufleet/store/sqlite/", "src/gpufleet/store/postgres/")
DIALECT_NAMES = ("postgres", "sqlite")  # string constants that name a dialect (a prefix)


def _modules() -> Iterator[tuple[str, str]]:
    """Each of our modules: its path from the repository root, and its text."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not any(part in f"/{rel}" for part in NOT_OURS):
            yield rel, path.read_text(encoding="utf-8")


def long_functions(source: str, most: int = MOST_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """Every function or method in ``source`` longer than ``most`` lines (from its ``def``
    to its last line): its name, first line and length."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > most:
                found.append((node.name, node.lineno, length))
    return found


def _names_dialect(node: ast.expr) -> bool:
    """``node`` reads the dialect: ``dialect``, ``x.dialect``, ``x.dialect.name`` or
    ``getattr(x, "dialect", ...)``."""
    if isinstance(node, ast.Name):
        return node.id == "dialect"
    if isinstance(node, ast.Attribute):
        return node.attr == "dialect" or (node.attr == "name" and _names_dialect(node.value))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
        name = node.args[1] if len(node.args) > 1 else None
        return isinstance(name, ast.Constant) and name.value == "dialect"
    return False


def _is_pg(node: ast.AST) -> bool:
    """``node`` names an ``is_pg`` flag (read, set, or a parameter): one exists only to
    be branched on."""
    return (
        (isinstance(node, ast.Name) and node.id == "is_pg")
        or (isinstance(node, ast.Attribute) and node.attr == "is_pg")
        or (isinstance(node, ast.arg) and node.arg == "is_pg")
        or (isinstance(node, ast.keyword) and node.arg == "is_pg")
    )


def _names_a_dialect(node: ast.expr) -> bool:
    """``node`` is a string naming a dialect (``"postgresql"``, ``"sqlite"``), or a
    collection holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower().startswith(DIALECT_NAMES)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_dialect(e) for e in node.elts)
    return False


def dialect_branches(source: str) -> list[tuple[int, str]]:
    """Every place in ``source`` that branches on the database's dialect: a comparison
    with the dialect (``dialect == ...``, ``engine.dialect.name != ...``) or with a
    dialect's name (``... == "postgresql"``), a ``match`` on the dialect, a test of an
    ``is_pg`` flag anywhere, or ``dialect.startswith(...)``. Each: its line and its code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = _is_pg(node)
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            hit = any(_names_dialect(o) or _names_a_dialect(o) for o in operands)
        elif isinstance(node, ast.Match):
            hit = _names_dialect(node.subject)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = node.func.attr in ("startswith", "endswith") and _names_dialect(node.func.value)
        if hit:
            line = getattr(node, "lineno", 0)
            found.append((line, ast.get_source_segment(source, node) or "is_pg"))
    return found


def test_no_module_is_over_600_lines() -> None:
    over = []
    for rel, text in _modules():
        lines = len(text.splitlines())
        if lines > MOST_MODULE_LINES:
            over.append(f"{rel}: {lines} lines")
    assert not over, f"modules over {MOST_MODULE_LINES} lines (split them by meaning):\n" + (
        "\n".join(over)
    )


def test_no_function_is_over_50_lines() -> None:
    over = [
        f"{rel}:{line} {name}: {length} lines"
        for rel, text in _modules()
        for name, line, length in long_functions(text)
    ]
    assert not over, f"functions over {MOST_FUNCTION_LINES} lines:\n" + "\n".join(over)


def test_no_dialect_branch_outside_the_backends() -> None:
    found = [
        f"{rel}:{line}: {code}"
        for rel, text in _modules()
        if not rel.startswith(BACKENDS)
        for line, code in dialect_branches(text)
    ]
    assert not found, (
        "a branch on the database's dialect outside store/sqlite/ and store/postgres/ "
        "(make it a method each backend overrides):\n" + "\n".join(found)
    )


# Where a transaction must be passed explicitly.
EXPLICIT = ("src/gpufleet/store/", "src/gpufleet/server/")


def context_variables(source: str) -> list[tuple[int, str]]:
    """Every import of :mod:`contextvars` (or of a name from it) in ``source``: its line
    and what it imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name == "contextvars"]
        elif isinstance(node, ast.ImportFrom) and node.module == "contextvars":
            found += [(node.lineno, f"contextvars.{a.name}") for a in node.names]
    return found


def test_no_context_variable_in_the_store_or_the_server() -> None:
    found = [
        f"{rel}:{line}: {name}"
        for rel, text in _modules()
        if rel.startswith(EXPLICIT)
        for line, name in context_variables(text)
    ]
    assert not found, (
        "a context variable in store/ or server/ (pass the unit of work, "
        "Store.transaction, where a transaction is meant):\n" + "\n".join(found)
    )


def test_a_context_variable_is_found() -> None:
    assert context_variables("from contextvars import ContextVar\n") == [
        (1, "contextvars.ContextVar")
    ]
    assert context_variables("import contextvars\n") == [(1, "contextvars")]
    assert context_variables("import contextlib\n") == []


BRANCHES = [
    'if store.dialect == "postgresql":\n    pass',
    'if self.dialect != "sqlite":\n    pass',
    'x = 1 if conn.dialect.name == "postgresql" else 2',
    'if engine.dialect.name in ("postgresql", "postgres"):\n    pass',
    'if getattr(store, "dialect", None) == "sqlite":\n    pass',
    'if kind == "postgresql":\n    pass',
    "if is_pg:\n    pass",
    "if not self.is_pg:\n    pass",
    "y = a and store.is_pg",
    "def f(is_pg: bool) -> None:\n    pass",
    'if dialect.startswith("postgres"):\n    pass',
    "match conn.dialect.name:\n    case 'sqlite':\n        pass",
]
NOT_BRANCHES = [
    'dialect = "postgresql"  # a backend names itself',
    'log.info("store: %s", store.dialect)',
    'if url.startswith("postgresql"):\n    pass',  # choosing the backend from the URL
    '"""Say postgresql == sqlite in prose."""',
    "# if dialect == 'sqlite': a comment",
    'if name == "jobs":\n    pass',
]


@pytest.mark.parametrize("source", BRANCHES)
def test_a_dialect_branch_is_found(source: str) -> None:
    assert dialect_branches(source), source


@pytest.mark.parametrize("source", NOT_BRANCHES)
def test_what_is_not_a_dialect_branch_is_not_found(source: str) -> None:
    assert not dialect_branches(source), source


def test_a_long_function_is_found_with_its_length() -> None:
    body = "".join(f"    x{n} = {n}\n" for n in range(MOST_FUNCTION_LINES))
    source = f"class A:\n    def short(self):\n        pass\n\n    def long(self):\n{body}"
    source = source.replace("\n    x", "\n        x")
    assert long_functions(source) == [("long", 5, MOST_FUNCTION_LINES + 1)]
