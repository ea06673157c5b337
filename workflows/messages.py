"""Reading what a plain Temporal client sends to a job's signals and updates.

`temporal workflow signal --name cancel` sends no argument at all; a script may send `{}`, a
bare string, a misspelt field (`{"why": ...}`) or a reason of a megabyte. A handler whose
signature cannot take that fails every workflow task from then on and wedges the job, so the
handlers take `Any` and read it here:

- signals have no reply channel: what can be used is used, the rest is dropped and noted
  (`JobStatus.notices`), never raised;
- updates have one: their validators call `strict_message`, which rejects with a message that
  says what to send instead, before anything is recorded in history.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from workflows.contracts import JobState, JobStatus, ResumeRequest

M = TypeVar("M", bound=BaseModel)

_SHOWN = 60  # characters of a rejected value worth repeating in a note


def lenient_message(
    model: type[M], payload: Any, *, scalar_field: str | None = None
) -> tuple[M, list[str]]:
    """The message as `model`, with defaults for whatever was missing or unusable.

    `scalar_field`: a bare value (not an object) is taken as this field, so
    `signal cancel "wrong seed"` works as a reason.
    """
    notes: list[str] = []
    if payload is None:
        data: dict[str, Any] = {}
    elif isinstance(payload, dict):
        data = dict(payload)
    elif scalar_field is not None:
        data = {scalar_field: payload}
    else:
        return model(), [f"ignored a {type(payload).__name__} payload: send an object"]
    known = model.model_fields
    usable: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            notes.append(f"ignored unknown field {str(key)[:_SHOWN]!r} (known: {', '.join(known)})")
            continue
        try:
            model.model_validate({key: value})
        except ValidationError as exc:
            error = exc.errors()[0]
            limit = (error.get("ctx") or {}).get("max_length")
            if error["type"] == "string_too_long" and isinstance(limit, int):
                usable[key] = value[:limit]
                notes.append(f"{key} cut to its first {limit} characters (of {len(value)})")
            else:
                notes.append(f"ignored {key}={_short(value)}: {error['msg']}")
            continue
        usable[key] = value
    try:
        return model.model_validate(usable), notes
    except ValidationError as exc:
        # Each field was fine alone and not together (a rule across fields): a signal still
        # must not raise, or it fails the workflow task.
        return model(), [*notes, f"ignored the whole message: {exc.errors()[0]['msg']}"]


def strict_message(model: type[M], payload: Any, *, what: str) -> M:
    """The message as `model`, or a ValueError saying what is wrong and what to send."""
    if payload is None:
        return model()
    if not isinstance(payload, dict):
        raise ValueError(f"{what} takes an object such as {_example(model)}, not {_short(payload)}")
    unknown = [key for key in payload if key not in model.model_fields]
    if unknown:
        raise ValueError(
            f"{what}: unknown field(s) {', '.join(repr(k) for k in unknown)}; "
            f"send an object such as {_example(model)}"
        )
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ValueError(f"{what}: {problems}") from None


def _example(model: type[BaseModel]) -> str:
    return model().model_dump_json()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def refuse_resume(status: JobStatus, payload: Any) -> None:
    """The `resume` update's validator: a ValueError saying why the job cannot take it now,
    and what to do instead."""
    request = strict_message(ResumeRequest, payload, what="resume")
    if status.state != JobState.NEEDS_DECISION:
        raise ValueError(
            f"the job is {status.state.value}: resume only continues a job that waits for a "
            "decision (NEEDS_DECISION)"
        )
    decision = status.decision
    if not request.resubmit and decision is not None and not decision.reattach_possible:
        raise ValueError(
            f"cannot re-attach: {decision.reason}. Resume with resubmit=true "
            f"({decision.options.get('resume --resubmit', 'run the prompt again')}), or "
            "cancel the job"
        )
