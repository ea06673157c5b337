"""Layers point one way: the product never imports the dev stack, the library never imports the
worker, and the workflow code imports no I/O.

    devstack/ -> starter/, activities/, workflows/, worker.py   (the dev stack uses the product)
    worker.py -> starter/ (connection), activities/, workflows/
    starter/  -> workflows/                                   (a client needs no worker code)
    activities/ -> workflows/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "workflows": {"devstack", "activities", "starter", "worker"},
    "activities": {"devstack", "starter", "worker"},
    "starter": {"devstack", "worker", "activities"},
    "worker.py": {"devstack"},
}
# The client library may use these activity modules for S3 (downloads, presigning, logging):
# they are I/O helpers with no worker state, imported only where a command needs them.
ALLOWED = {
    ("starter", "activities.storage"),
    ("starter", "activities.storage_errors"),
    ("starter", "activities.log_setup"),
}


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def files_of(layer: str) -> list[Path]:
    target = ROOT / layer
    return [target] if target.is_file() else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in files_of(layer)
        for module in sorted(imported_modules(path))
        if module.split(".")[0] in FORBIDDEN[layer] and (layer, module) not in ALLOWED
    ]
    assert offences == []
