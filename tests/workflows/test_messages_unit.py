"""`workflows/messages.py` on its own: what a plain client's payload becomes, word for word."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

from workflows.contracts import CancelRequest, ResumeRequest
from workflows.messages import lenient_message, strict_message


def test_nothing_or_an_empty_object_means_the_defaults() -> None:
    assert lenient_message(CancelRequest, None) == (CancelRequest(), [])
    assert lenient_message(CancelRequest, {}) == (CancelRequest(), [])
    assert strict_message(ResumeRequest, None, what="resume") == ResumeRequest()
    assert strict_message(ResumeRequest, {}, what="resume") == ResumeRequest()


def test_a_bare_value_is_the_scalar_field_or_is_refused() -> None:
    assert lenient_message(CancelRequest, "why not", scalar_field="reason") == (
        CancelRequest(reason="why not"),
        [],
    )
    assert lenient_message(ResumeRequest, True, scalar_field="resubmit")[0].resubmit is True
    message, notes = lenient_message(CancelRequest, ["a", "list"])
    assert message == CancelRequest()
    assert notes == ["ignored a list payload: send an object"]


def test_unknown_fields_are_named_with_the_known_ones() -> None:
    message, notes = lenient_message(CancelRequest, {"why": "typo", "reason": "kept"})
    assert message == CancelRequest(reason="kept")
    assert notes == ["ignored unknown field 'why' (known: reason)"]


def test_a_value_of_the_wrong_type_is_dropped_with_the_reason() -> None:
    message, notes = lenient_message(ResumeRequest, {"resubmit": "perhaps"})
    assert message == ResumeRequest()
    assert len(notes) == 1
    assert notes[0].startswith("ignored resubmit='perhaps': ")
    assert "bool" in notes[0]


def test_a_too_long_string_is_cut_to_its_limit_not_dropped() -> None:
    message, notes = lenient_message(CancelRequest, {"reason": "r" * 501})
    assert message.reason == "r" * 500
    assert notes == ["reason cut to its first 500 characters (of 501)"]
    exact, none = lenient_message(CancelRequest, {"reason": "r" * 500})
    assert exact.reason == "r" * 500 and none == []


def test_long_rejected_values_are_shortened_in_notes() -> None:
    _message, notes = lenient_message(ResumeRequest, {"resubmit": "x" * 200})
    shown = notes[0].split("=", 1)[1].split(":", 1)[0]
    assert shown == repr("x" * 200)[:60] + "..."
    _message, short = lenient_message(ResumeRequest, {"resubmit": "xy"})
    assert short[0].startswith("ignored resubmit='xy': ")


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ("yes", "resume takes an object such as {\"resubmit\":false}, not 'yes'"),
        ({"resubmt": True}, "resume: unknown field(s) 'resubmt'; send an object such as"),
        ({"resubmit": "perhaps"}, "resume: resubmit: Input should be a valid boolean"),
    ],
)
def test_strict_messages_refuse_with_what_to_send(payload: object, expected: str) -> None:
    with pytest.raises(ValueError) as refused:
        strict_message(ResumeRequest, payload, what="resume")
    assert str(refused.value).startswith(expected), str(refused.value)


def test_strict_messages_take_a_valid_object() -> None:
    assert strict_message(ResumeRequest, {"resubmit": True}, what="resume").resubmit is True


class _Pair(BaseModel):
    """Two fields (and a nested one): how notes join several names and problems."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=5)
    count: int = 0
    inner: _Inner = Field(default_factory=lambda: _Inner())


class _Inner(BaseModel):
    size: int = 0


_Pair.model_rebuild()


def test_every_known_field_is_named_and_each_unknown_one_noted() -> None:
    message, notes = lenient_message(_Pair, {"nme": "x", "cnt": 1, "count": 2})
    assert message.count == 2
    assert notes == [
        "ignored unknown field 'nme' (known: name, count, inner)",
        "ignored unknown field 'cnt' (known: name, count, inner)",
    ]


def test_a_long_unknown_field_name_is_shown_to_its_first_60_characters() -> None:
    key = "k" * 61
    _message, notes = lenient_message(_Pair, {key: 1})
    assert notes == [f"ignored unknown field {'k' * 60!r} (known: name, count, inner)"]


def test_a_cut_string_does_not_stop_the_fields_after_it_being_read() -> None:
    message, notes = lenient_message(_Pair, {"name": "abcdefg", "count": "many", "bogus": 1})
    assert message == _Pair(name="abcde")
    assert notes[0] == "name cut to its first 5 characters (of 7)"
    assert notes[1].startswith("ignored count='many': ")
    assert notes[2] == "ignored unknown field 'bogus' (known: name, count, inner)"


def test_a_rejected_value_of_exactly_60_characters_is_shown_whole() -> None:
    value = "x" * 58  # its repr, quotes included, is 60 characters
    _message, notes = lenient_message(_Pair, {"count": value})
    assert notes[0].startswith(f"ignored count={value!r}: ")
    longer = "x" * 59
    _message, notes = lenient_message(_Pair, {"count": longer})
    assert notes[0].startswith(f"ignored count={repr(longer)[:60]}...: ")


def test_strict_messages_name_every_unknown_field_and_every_problem() -> None:
    with pytest.raises(ValueError) as unknown:
        strict_message(_Pair, {"nme": 1, "cnt": 2}, what="pair")
    assert str(unknown.value) == (
        "pair: unknown field(s) 'nme', 'cnt'; send an object such as "
        '{"name":"","count":0,"inner":{"size":0}}'
    )
    with pytest.raises(ValueError) as invalid:
        strict_message(_Pair, {"count": "many", "inner": {"size": "big"}}, what="pair")
    assert str(invalid.value) == (
        "pair: count: Input should be a valid integer, unable to parse string as an integer; "
        "inner.size: Input should be a valid integer, unable to parse string as an integer"
    )


class _Tags(BaseModel):
    tags: list[str] = Field(default_factory=list, max_length=2)


def test_only_a_too_long_string_is_cut_a_too_long_list_is_dropped() -> None:
    message, notes = lenient_message(_Tags, {"tags": ["a", "b", "c"]})
    assert message.tags == []
    assert notes[0].startswith("ignored tags=['a', 'b', 'c']: List should have at most 2 items")
