"""Layering: tests never import `experiments`, experiments never import `tests` (shared code
lives in the package, e.g. jkv/scheduling/testing.py), the installed packages import neither,
read from the import statements (ast), and no script puts tests/ on sys.path."""
import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def imported_roots(path: pathlib.Path) -> set[str]:
    """Top-level package of every absolute import in `path`."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def path_strings(path: pathlib.Path) -> set[str]:
    """String constants in `path` that are single path components (e.g. "tests" in
    `ROOT / "tests" / "scheduling"`), to catch a tree put on sys.path by hand."""
    return {node.value for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


@pytest.mark.parametrize("tree, forbidden", [("tests", "experiments"), ("experiments", "tests")]
                         + [(package, outside) for package in ("jkv", "models", "transport",
                                                              "pallas_kernels")
                            for outside in ("experiments", "tests")])
def test_no_import_across_tests_and_experiments(tree, forbidden):
    files = sorted((REPO / tree).rglob("*.py"))
    assert files, f"no Python files under {tree}/"
    offenders = [str(p.relative_to(REPO)) for p in files if forbidden in imported_roots(p)]
    assert not offenders, f"{offenders} import `{forbidden}`; move the shared code into jkv/"


def test_experiments_do_not_put_tests_on_the_path():
    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "experiments").rglob("*.py"))
                 if "sys.path" in p.read_text() and "tests" in path_strings(p)]
    assert not offenders, f"{offenders} put tests/ on sys.path; import from jkv/ instead"


def test_the_checks_see_an_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom experiments.calvo import main\nfrom . import sibling\n")
    assert imported_roots(probe) == {"os", "experiments"}
