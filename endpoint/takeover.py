"""What a delivery that takes a claim over still has to do, from what the claim says is done.

A holder records its prompt's end in the claim at once (`prompt_end`: with `success`, every
output file ComfyUI's history lists) and each output as it is stored (`stored`). When it dies
before it records the outcome, the delivery that takes the claim over (endpoint/claims.py keeps
both across the takeover when the prompt succeeded) does only what is left:

- every listed output stored: nothing runs; the claim is finished `completed` with the records;
- some missing: the graph runs without the output nodes whose every file is stored, provided
  no other node links from them (a node others read from must run for them); ComfyUI runs
  only what the remaining output nodes need, so the rest of the graph stays idle. The result
  carries the earlier records of the nodes left out, with what the new run stores;
- no successful prompt recorded (none, or it failed or was cut short): the whole graph again.

Outputs are matched by (node, subfolder, filename): a record of a file no longer listed (an
earlier run's, of a node that ran again) is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from protocol.comfyui.events import output_files
from protocol.comfyui.follower import PromptEnd as FollowedEnd
from protocol.comfyui.history import outputs_of
from protocol.runpod.contract import ArtifactRecord, Claim, OutputFile, PromptEnd

OutputName = tuple[str, str, str]  # node_id, subfolder, filename


@dataclass(frozen=True)
class Left:
    """What a delivery holding the claim has to run."""

    graph: dict[str, Any]
    # Records of outputs it does not produce again (the nodes left out), in the order listed.
    kept: list[ArtifactRecord] = field(default_factory=list)
    # The files those nodes wrote, as the earlier prompt's end listed them.
    kept_outputs: list[OutputFile] = field(default_factory=list)
    # Every listed output is stored: nothing is left to run.
    done: bool = False
    # The output nodes left out of the graph.
    dropped: tuple[str, ...] = ()


def what_is_left(claim: Claim, graph: Mapping[str, Any]) -> Left:
    """From the claim as taken over (its `prompt_end` and `stored`), what to run of `graph`."""
    ended = claim.prompt_end
    if ended is None or ended.outcome != "success":
        return Left(dict(graph))
    records = {_name_of(record): record for record in claim.stored}
    listed: dict[str, list[OutputFile]] = {}
    for output in ended.outputs:
        listed.setdefault(output.node_id, []).append(output)
    complete = {
        node
        for node, outputs in listed.items()
        if all((o.node_id, o.subfolder, o.filename) in records for o in outputs)
    }
    if complete == set(listed):
        kept = [records[(o.node_id, o.subfolder, o.filename)] for o in ended.outputs]
        return Left({}, kept, list(ended.outputs), done=True, dropped=tuple(sorted(complete)))
    dropped = complete - _linked_from(graph)
    kept_outputs = [o for o in ended.outputs if o.node_id in dropped]
    return Left(
        {node: spec for node, spec in graph.items() if str(node) not in dropped},
        [records[(o.node_id, o.subfolder, o.filename)] for o in kept_outputs],
        kept_outputs,
        dropped=tuple(sorted(dropped)),
    )


def recorded_end(end: FollowedEnd, kept: Iterable[OutputFile] = ()) -> PromptEnd:
    """The claim's record of a prompt that ended: with success, the files its history lists,
    after those of the nodes an earlier run produced and this one left out (`kept`)."""
    outputs: list[OutputFile] = []
    if end.outcome == "success":
        outputs = list(kept)
        seen = {(o.node_id, o.subfolder, o.filename) for o in outputs}
        for node_id, item in output_files(outputs_of(end.entry)):
            if item.get("type", "output") != "output":
                continue  # previews are no outputs
            output = OutputFile(
                node_id=node_id, filename=item["filename"], subfolder=item.get("subfolder", "")
            )
            if (output.node_id, output.subfolder, output.filename) not in seen:
                seen.add((output.node_id, output.subfolder, output.filename))
                outputs.append(output)
    return PromptEnd(outcome=end.outcome, at=datetime.now(UTC), outputs=outputs)


def with_kept(kept: list[ArtifactRecord], records: list[ArtifactRecord]) -> list[ArtifactRecord]:
    """A run's result: the records it kept from an earlier run, then its own (an output it
    found again, on the worker that stored it, once)."""
    names = {_name_of(record) for record in kept}
    return [*kept, *(record for record in records if _name_of(record) not in names)]


def _name_of(record: ArtifactRecord) -> OutputName:
    return (record.node_id, record.subfolder, record.filename)


def _linked_from(graph: Mapping[str, Any]) -> set[str]:
    """The nodes some other node reads an output of (`[node_id, index]` inputs)."""
    return {
        str(value[0])
        for node in graph.values()
        if isinstance(node, dict)
        for value in (node.get("inputs") or {}).values()
        if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)
    }
