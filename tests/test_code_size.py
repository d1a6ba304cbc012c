"""Size bounds that keep the code walkable (STYLE.md "One concept per file"; issue 17):
no module of the engine packages over MAX_MODULE_LINES, no function outside experiments/ over
MAX_FUNCTION_LINES. Measured with ast, so a docstring or a comment counts like code."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
BOUNDED_PACKAGES = ("jkv", "models", "transport", "pallas_kernels")
# and every hidden folder (.venv, .venv312 of the second CI stage, .git, caches)
SKIP_DIRS = {"experiments", "build", "dist", "__pycache__"}
KNOWN_LONG_MODULES: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[tuple[str, str]] = set()  # (path, function name)


def _sources():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if not SKIP_DIRS.intersection(rel.parts) and not any(p.startswith(".") for p in rel.parts):
            yield rel, path.read_text()


def _long_modules(sources, limit):
    return [(rel.as_posix(), text.count("\n")) for rel, text in sources
            if rel.parts[0] in BOUNDED_PACKAGES and text.count("\n") > limit
            and rel.as_posix() not in KNOWN_LONG_MODULES]


def _long_functions(sources, limit):
    out = []
    for rel, text in sources:
        for node in ast.walk(ast.parse(text, str(rel))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit and (rel.as_posix(), node.name) not in KNOWN_LONG_FUNCTIONS:
                    out.append((rel.as_posix(), node.name, lines))
    return out


def test_no_module_of_the_engine_packages_is_over_the_bound():
    assert _long_modules(list(_sources()), MAX_MODULE_LINES) == [], (
        f"split these modules (one concept per file, <= {MAX_MODULE_LINES} lines)")


def test_no_function_outside_experiments_is_over_the_bound():
    assert _long_functions(list(_sources()), MAX_FUNCTION_LINES) == [], (
        f"split these functions (<= {MAX_FUNCTION_LINES} lines)")


@pytest.mark.parametrize("lines, expect", [(MAX_FUNCTION_LINES, []), (MAX_FUNCTION_LINES + 1, ["f"])])
def test_the_function_check_counts_lines_from_def_to_last_line(lines, expect):
    body = "\n".join(["def f():"] + ["    x = 1"] * (lines - 2) + ["    return x"]) + "\n"
    assert [name for _, name, _ in _long_functions([(pathlib.Path("jkv/x.py"), body)], MAX_FUNCTION_LINES)] == expect


def test_the_module_check_only_bounds_the_engine_packages():
    long_text = "x = 1\n" * (MAX_MODULE_LINES + 1)
    sources = [(pathlib.Path("jkv/a.py"), long_text), (pathlib.Path("tests/b.py"), long_text)]
    assert _long_modules(sources, MAX_MODULE_LINES) == [("jkv/a.py", MAX_MODULE_LINES + 1)]
