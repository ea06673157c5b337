"""Property tests of how the job reads its messages (workflows/messages.py), no servers.

A signal handler that raises fails the workflow task (for ever, as it replays), so a signal's
reading must never raise, whatever arrives; an update's validator may only refuse with a
ValueError (the client gets it; nothing is recorded).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError, model_validator

from tests.support.properties import FIXED, json_values
from workflows.contracts import CancelRequest, ProgressReport, ResumeRequest
from workflows.messages import lenient_message, strict_message

MODELS: list[Any] = [CancelRequest, ResumeRequest]
MESSAGES = st.sampled_from(MODELS)
PAYLOADS = st.one_of(
    json_values(),
    st.dictionaries(st.sampled_from(["reason", "resubmit", "why"]), json_values(4), max_size=3),
    st.text(min_size=490, max_size=2000).map(lambda reason: {"reason": reason}),
)


@settings(FIXED, max_examples=400)
@given(MESSAGES, PAYLOADS, st.sampled_from([None, "reason", "resubmit"]))
def test_a_signal_reading_never_raises_and_keeps_only_valid_values(
    model: type[CancelRequest] | type[ResumeRequest], payload: Any, scalar: str | None
) -> None:
    message, notes = lenient_message(model, payload, scalar_field=scalar)
    assert isinstance(message, model)
    model.model_validate(message.model_dump())  # what is kept is valid
    assert all(isinstance(note, str) and len(note) < 600 for note in notes)


@settings(FIXED, max_examples=300)
@given(MESSAGES, PAYLOADS)
def test_an_update_validator_refuses_only_with_a_value_error(
    model: type[CancelRequest] | type[ResumeRequest], payload: Any
) -> None:
    try:
        strict_message(model, payload, what="resume")
    except ValueError as refused:
        assert not isinstance(refused, ValidationError), "a reason, not pydantic's report"
        assert str(refused).startswith("resume")


@settings(FIXED, max_examples=300)
@given(json_values())
def test_a_progress_report_of_garbage_is_a_validation_error_and_nothing_else(
    payload: Any,
) -> None:
    try:
        ProgressReport.model_validate(payload)
    except ValidationError:
        return


class Window(BaseModel):
    """A message whose fields are fine alone and wrong together."""

    low: int = 0
    high: int = 10

    @model_validator(mode="after")
    def _ordered(self) -> Window:
        if self.low > self.high:
            raise ValueError("low must not be above high")
        return self


def test_fields_valid_alone_and_invalid_together_are_dropped_with_a_note() -> None:
    message, notes = lenient_message(Window, {"low": 5, "high": 3})
    assert message == Window()
    assert notes == ["ignored the whole message: Value error, low must not be above high"]


@pytest.mark.parametrize("payload", [[1, 2], 3.5, "x", True])
def test_a_bare_value_without_a_scalar_field_is_noted_not_raised(payload: Any) -> None:
    message, notes = lenient_message(ResumeRequest, payload)
    assert message == ResumeRequest() and "send an object" in notes[0]
