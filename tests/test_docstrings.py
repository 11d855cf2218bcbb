"""Every public class and function of features/ and predictor/ says what it is for (the router plugin and the
service are built on them), and of dashboards/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _undocumented_in(node: ast.AST, where: str, prefix: str = "") -> list[str]:
    missing = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not child.name.startswith("_"):
            if ast.get_docstring(child) is None:
                missing.append(f"{where}:{child.lineno} {prefix}{child.name}")
            if isinstance(child, ast.ClassDef):
                missing += _undocumented_in(child, where, f"{prefix}{child.name}.")
    return missing


def undocumented(package: str) -> list[str]:
    missing = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):  # generated
            missing += _undocumented_in(ast.parse(path.read_text()), str(path.relative_to(ROOT)))
    return missing


def test_public_classes_and_functions_have_docstrings() -> None:
    missing = undocumented("features") + undocumented("predictor") + undocumented("dashboards")
    assert not missing, "\n".join(missing)
