"""The workflow stays in one place: no module split off for size alone, `InferenceJob` short
enough to read in one sitting with its story (`run`) first and its handlers on the class, and no
pool spelled "" (None is "not named yet", everywhere)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import workflows
from workflows.inference_job import InferenceJob

WORKFLOWS = Path(workflows.__file__).parent
ACTIVITIES = WORKFLOWS.parent / "activities"
# Under this, a module holds too little to stand alone: it belongs with what uses it.
MIN_LINES = 40
MAX_WORKFLOW_LINES = 300


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_workflows_module_is_a_fragment() -> None:
    short = {
        path.name: lines(path)
        for path in WORKFLOWS.glob("*.py")
        if path.name != "__init__.py" and lines(path) < MIN_LINES
    }
    assert short == {}


def test_the_workflow_reads_in_one_sitting_run_first() -> None:
    source = WORKFLOWS / "inference_job.py"
    assert lines(source) <= MAX_WORKFLOW_LINES
    [cls] = [
        node
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "InferenceJob"
    ]
    methods = [n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert methods[0] == "run"
    # The handlers are the class's own: no base to look them up in.
    assert InferenceJob.__bases__ == (object,)
    assert {"status", "events", "cancel", "cancel_reason", "resume", "ended"} <= set(methods)


# `pool or ""`, `pool=""`, `pool == ""`, `pool: str = ""`, in any spelling of the name.
EMPTY_POOL = re.compile(r"""\bpool\w*\s*(?::\s*str\s*)?(?:or|==|!=|=)\s*(?:""|'')""")


def test_no_pool_is_spelled_empty() -> None:
    found = [
        f"{path.relative_to(WORKFLOWS.parent)}:{number}: {line.strip()}"
        for path in [*WORKFLOWS.glob("*.py"), *ACTIVITIES.rglob("*.py")]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if EMPTY_POOL.search(line)
    ]
    assert found == []
    assert EMPTY_POOL.search('pool=request.pool or ""') and EMPTY_POOL.search('pool: str = ""')
