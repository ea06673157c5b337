"""workflows/contracts.py: the request, the policy and the status models.

End states, policy defaults, job ids, pools, and refusals compared whole.
"""

from __future__ import annotations

from typing import Any, get_args

import pytest
from pydantic import ValidationError

from workflows.contracts import (
    DEFAULT_WEBHOOK_EVENTS,
    ENDINGS,
    TERMINAL_STATES,
    JobPolicy,
    JobRequest,
    JobState,
    JobStatus,
    ReconnectPolicy,
    WebhookEventName,
    validate_job_id,
)

GRAPH: dict[str, Any] = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8}}}


def test_exactly_the_end_states_are_terminal() -> None:
    ended = {"COMPLETED", "FAILED", "CANCELLED", "ABANDONED", "EXPIRED", "TERMINATED", "TIMED_OUT"}
    assert {s.value for s in JobState if s.terminal} == ended
    assert {s.value for s in TERMINAL_STATES} == ended
    for state in JobState:
        assert JobStatus(job_id="j", state=state).terminal is (state.value in ended)


def test_the_endings_name_the_webhook_events_a_request_gets_unasked() -> None:
    """Derived from ENDINGS: every ending a webhook can tell, and a call for a person (a
    request names its events when it is sent, so an earlier client's list is its own)."""
    events = [e.webhook_event for e in ENDINGS.values() if e.webhook_event is not None]
    assert set(events) <= set(get_args(WebhookEventName))
    assert DEFAULT_WEBHOOK_EVENTS == (
        "completed",
        "failed",
        "cancelled",
        "abandoned",
        "expired",
        "needs_decision",
    )
    # Set only by Temporal's own record of a workflow ended from outside: no webhook tells.
    assert {s for s, e in ENDINGS.items() if e.webhook_event is None} == {
        JobState.TERMINATED,
        JobState.TIMED_OUT,
    }


def test_the_reconnect_ceiling_may_equal_but_not_undercut_the_base_delay() -> None:
    assert ReconnectPolicy(base_delay_s=5, max_delay_s=5).max_delay_s == 5
    with pytest.raises(ValidationError) as refused:
        ReconnectPolicy(base_delay_s=5, max_delay_s=4.9)
    assert refused.value.errors()[0]["msg"] == (
        "Value error, reconnect.max_delay_s must be >= reconnect.base_delay_s"
    )


@pytest.mark.parametrize(
    ("data", "abandon_after_s"),
    [
        ({}, 300.0),
        ({"reconnect": {}}, 300.0),
        ({"reconnect": {"base_delay_s": 2}}, 300.0),
        ({"reconnect": {"horizon_s": 42}}, 42.0),
        ({"reconnect": ReconnectPolicy(horizon_s=17)}, 17.0),
        ({"reconnect": {"horizon_s": 42}, "abandon_after_s": 60}, 60.0),
        ({"reconnect": {"horizon_s": 42}, "abandon_after_s": None}, None),
    ],
)
def test_abandonment_follows_the_reconnect_horizon_unless_given(
    data: dict[str, Any], abandon_after_s: float | None
) -> None:
    policy = JobPolicy.model_validate(data)
    assert policy.abandon_after_s == abandon_after_s
    assert policy.detached is (abandon_after_s is None)
    assert JobPolicy.model_validate_json(policy.model_dump_json()) == policy


def test_a_policy_passed_as_a_model_is_kept_as_it_is() -> None:
    policy = JobPolicy(abandon_after_s=None)
    assert JobRequest(graph=GRAPH, policy=policy).policy.detached
    assert JobPolicy.model_validate(policy) == policy


def test_a_request_keeps_its_graph_as_given() -> None:
    assert JobRequest(graph=GRAPH).graph == GRAPH


@pytest.mark.parametrize(("segments", "count"), [(0, 1), (1, 1), (3, 3)])
def test_a_request_runs_its_graph_once_per_segment_and_once_without(
    segments: int, count: int
) -> None:
    request = JobRequest(graph=GRAPH, segments=[{"1": {"width": n}} for n in range(segments)])
    assert request.segment_count == count


def test_a_request_refuses_a_bad_graph_with_the_graph_check_message() -> None:
    with pytest.raises(ValidationError) as refused:
        JobRequest(graph={})
    assert refused.value.errors()[0]["msg"] == (
        "Value error, the graph is empty: it needs at least one node"
    )


@pytest.mark.parametrize("job_id", ["a", "job-1_x.y:z", "A" * 200])
def test_good_job_ids_come_back_unchanged(job_id: str) -> None:
    assert validate_job_id(job_id) == job_id


def test_a_bad_job_id_is_refused_saying_what_is_allowed() -> None:
    with pytest.raises(ValueError) as refused:
        validate_job_id("job/1")
    assert str(refused.value) == (
        "job id 'job/1' is not valid: use 1-200 characters from A-Z a-z 0-9 _ . : -"
    )


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"execution_timeout_s": True}, "execution_timeout_s"),
        ({"heartbeat_timeout_s": "20"}, "heartbeat_timeout_s"),
        ({"abandon_after_s": False}, "abandon_after_s"),
        ({"history_budget_events": 2000.5}, "history_budget_events"),
        ({"reconnect": {"horizon_s": True}}, "horizon_s"),
    ],
)
def test_policy_numbers_are_numbers(policy: dict[str, Any], field: str) -> None:
    """`true` is not one second, nor "20" twenty: a sloppy client is told, not guessed at."""
    with pytest.raises(ValidationError, match=field):
        JobRequest.model_validate({"graph": {"1": {"class_type": "X"}}, "policy": policy})
    assert JobPolicy.model_validate({"execution_timeout_s": 60, "reconnect": {"horizon_s": 9.5}})


@pytest.mark.parametrize("job_id", ["", "a b", "x" * 201])
def test_bad_job_ids_are_refused(job_id: str) -> None:
    with pytest.raises(ValueError, match="not valid"):
        validate_job_id(job_id)


def test_a_request_refuses_the_editor_format_with_the_export_hint() -> None:
    with pytest.raises(ValidationError) as info:
        JobRequest(graph={"nodes": [{"id": 1}], "links": [], "version": 0.4})
    assert "export the workflow in API format" in str(info.value)


def test_request_never_carries_a_url_as_pool() -> None:
    with pytest.raises(ValidationError):
        JobRequest(graph=GRAPH, pool="http://10.0.0.1:8188")


def test_status_round_trips_through_json() -> None:
    status = JobStatus(job_id="j1")
    assert JobStatus.model_validate_json(status.model_dump_json()) == status
