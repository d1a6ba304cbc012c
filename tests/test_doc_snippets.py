"""The Python snippets in README.md and docs/*.md that build the disaggregation configs use them as
they are: each such block parses, its `from jkv... import` lines import, and each `Disaggregation(...)`
/ `TransferConfig(...)` call in it constructs (the configs validate their fields; running a model is
the examples' job, not this test's). Other blocks may be sketches and are not read."""
import ast
import pathlib
import re

import pytest

from jkv import Disaggregation, TransferConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CONFIGS = {"Disaggregation": Disaggregation, "TransferConfig": TransferConfig}


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def config_calls(tree: ast.AST) -> list[ast.Call]:
    """The outermost calls of a config class (a TransferConfig inside a Disaggregation runs with it)."""
    calls, inner = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in CONFIGS and id(node) not in inner:
            calls.append(node)
            inner |= {id(n) for n in ast.walk(node) if n is not node}
    return calls


SNIPPETS = [(path, i, block) for path in DOCS for i, block in enumerate(python_blocks(path))
            if any(name + "(" in block for name in CONFIGS)]


def test_the_docs_have_config_snippets():
    calls = [c for _, _, block in SNIPPETS for c in config_calls(ast.parse(block))]
    assert len(calls) >= 3  # README's LLM example and compression example, docs/smartgen.md's


@pytest.mark.parametrize("path, index, block", SNIPPETS,
                         ids=[f"{p.relative_to(REPO)}#{i}" for p, i, _ in SNIPPETS])
def test_snippet_uses_the_current_api(path, index, block):
    tree = ast.parse(block, f"{path.name} python block {index}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jkv":
            exec(compile(ast.Module([node], []), path.name, "exec"), {})
    for call in config_calls(tree):
        eval(compile(ast.Expression(call), path.name, "eval"), dict(CONFIGS))
