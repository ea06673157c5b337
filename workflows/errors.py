"""Every exception the workflow and the activities raise of their own, one tree a section.

    ValueError
    ├── GraphFormatError          the graph is not an API-format prompt (its tree below)
    ├── RequestRefused            a part of the request out of bounds (`field` names it)
    └── AreaError                 storage outside the tenant's area
        ├── InputOutsideArea      an `s3://` input
        └── OutputOutsideArea     `output.prefix` or `output.bucket`

The clients and the gateway raise and read them too (they may import workflows/, not the
activities). Where they cross into Temporal, activities/errors.py maps them, once, to an
`ApplicationError` typed with `workflows.shared.ErrorType`; a class name is what Temporal
records of anything else, so none is ever renamed. Sandboxed workflow modules import this
module inside `workflow.unsafe.imports_passed_through()`, as every other workflows import:
`failure_exception_types` must hold the very class the graph checks raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# -- the graph ---------------------------------------------------------------------------------

# Problems a refusal's message lists before "and N more".
SHOWN_PROBLEMS = 20


class GraphFormatError(ValueError):
    """The graph is not a ComfyUI API-format prompt. The message says what to fix.

    Subclasses (all `GraphRefused`) carry the problems one by one, each naming its node and
    field, so a caller can point at them (`JobError` details, an editor):

        GraphRefused
        ├── GraphShapeError        not `{node_id: {class_type, inputs}}`, or a dangling link
        ├── GraphTooLarge          over a size bound: bytes, nodes, inputs, a string, nesting
        ├── GraphNameError         a node id or class_type too long or with control characters
        ├── GraphLinkError         a link's output index is not a small whole number
        ├── GraphCycleError        the links go round in a circle
        ├── UndeclaredInputFile    a load node names a file that is not a declared input
        ├── ForeignFileReference   a value that reaches for a file not the job's own: an
        │                          `[output]`/`[temp]` annotation, a path, another job's file
        ├── UnclassifiedNode       a class the pool's registry cannot describe, on a pool
        │                          that refuses those (`unclassified_inputs: refuse`)
        └── NodeClassNotAllowed    a class outside the pool's allow-list
    """


@dataclass(frozen=True)
class GraphProblem:
    """One thing wrong with a graph. `node` is None for the graph as a whole; `field` is
    `graph`, `class_type`, `inputs` or `inputs.<name>`."""

    node: str | None
    field: str
    message: str

    def as_dict(self) -> dict[str, str | None]:
        """JSON-safe: a lone surrogate in a hostile name would fail the payload's encoding."""
        node = None if self.node is None else safe_text(self.node)
        return {"node": node, "field": safe_text(self.field), "message": safe_text(self.message)}


def safe_text(text: str) -> str:
    """`text` with anything that has no UTF-8 form (lone surrogates) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class GraphRefused(GraphFormatError):
    """One or more `GraphProblem`s of one kind; the message lists them (at most
    `SHOWN_PROBLEMS`, then how many more)."""

    summary = "invalid API-format graph"

    def __init__(self, problems: Sequence[GraphProblem], *, summary: str | None = None) -> None:
        if not problems:
            raise ValueError("a refusal needs at least one problem")
        self.problems = list(problems)
        summary = summary if summary is not None else self.summary
        shown = "; ".join(p.message for p in self.problems[:SHOWN_PROBLEMS])
        more = len(self.problems) - SHOWN_PROBLEMS
        if more > 0:
            shown += f"; and {more} more"
        super().__init__(f"{summary}: {shown}" if summary else shown)

    @property
    def node(self) -> str | None:
        """The node of the first problem (None: the graph as a whole)."""
        return self.problems[0].node

    @property
    def field(self) -> str:
        return self.problems[0].field


class GraphShapeError(GraphRefused):
    pass


class GraphTooLarge(GraphRefused):
    summary = "graph too large"


class GraphNameError(GraphRefused):
    summary = "invalid node id or class_type"


class GraphLinkError(GraphRefused):
    summary = "invalid link"


class GraphCycleError(GraphRefused):
    summary = "the graph has a cycle (ComfyUI cannot run it)"


class UndeclaredInputFile(GraphRefused):
    summary = "input file not declared"


class ForeignFileReference(GraphRefused):
    summary = "a node reads a file that is not the job's own"


class UnclassifiedNode(GraphRefused):
    summary = "node class unknown to the pool's registry"


class NodeClassNotAllowed(GraphRefused):
    summary = "node class not allowed"


# -- the rest of the request -------------------------------------------------------------------


class RequestRefused(ValueError):
    """A part of the request out of bounds. `field` is its dotted path in the request."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AreaError(ValueError):
    """A request names storage outside its tenant's area. The message says what to send."""


class InputOutsideArea(AreaError):
    """An `s3://` input outside the tenant's area and every allowed prefix."""


class OutputOutsideArea(AreaError):
    """`output.prefix` or `output.bucket` (`field`) outside the tenant's area."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
