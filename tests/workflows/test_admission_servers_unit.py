"""The queue's choice of server on a pool of many (workflows/admission.py): each server holds
at most its slots, the least loaded takes the next job, then the one whose models are warm; an
unhealthy or drained server takes no new job and keeps what it runs."""

from __future__ import annotations

from datetime import UTC, datetime

from workflows.admission import (
    EndpointHealth,
    PoolLine,
    QueueState,
    SlotRequest,
    place_in_line,
)

T0 = datetime(2026, 12, 7, tzinfo=UTC)
A, B, C = "http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"


def ask(
    line: PoolLine,
    job_id: str,
    *,
    servers: tuple[str, ...] = (A, B),
    slots: int = 1,
    graph: str | None = None,
    max_running: int | None = None,
) -> None:
    line.request(
        SlotRequest(
            job_id=job_id,
            tenant="t",
            max_running=max_running or len(servers) * slots,
            accepted_at=T0,
            servers=list(servers),
            server_slots=slots,
            graph_key=graph,
        ),
        T0,
    )


def granted(line: PoolLine) -> dict[str, str | None]:
    return {h.job_id: h.server for h in line.grants(T0)}


def test_each_server_gets_one_job_and_the_rest_wait_for_a_free_server() -> None:
    line = PoolLine(QueueState(pool="farm"))
    for n in range(4):
        ask(line, f"j{n}")
    assert granted(line) == {"j0": A, "j1": B}
    assert line.waiting == 2 and line.free_slots() == 0
    line.release("j1", T0)
    # The freed server, not the busy one, takes the next in line.
    assert granted(line) == {"j2": B}
    assert line.admission_of("j2", T0).server == B  # type: ignore[union-attr]


def test_the_least_loaded_server_first_with_two_slots_each() -> None:
    line = PoolLine(QueueState(pool="farm"))
    for n in range(3):
        ask(line, f"j{n}", slots=2)
    assert granted(line) == {"j0": A, "j1": B, "j2": A}
    assert line.server_loads() == {A: 2, B: 1}


def test_a_server_that_last_ran_the_same_graph_is_preferred_among_equally_loaded() -> None:
    line = PoolLine(QueueState(pool="farm"))
    ask(line, "sdxl-1", graph="sdxl")
    ask(line, "flux-1", graph="flux")
    assert granted(line) == {"sdxl-1": A, "flux-1": B}
    line.release("sdxl-1", T0)
    line.release("flux-1", T0)
    # Both idle: a flux job goes where flux's models are loaded, not to the first server.
    ask(line, "flux-2", graph="flux")
    assert granted(line) == {"flux-2": B}


def test_an_unhealthy_server_takes_no_job_and_keeps_its_running_one() -> None:
    line = PoolLine(QueueState(pool="farm"))
    for n in range(3):
        ask(line, f"j{n}")
    assert granted(line) == {"j0": A, "j1": B}
    assert line.set_health(A, "no answer to GET /queue", T0)
    assert not line.set_health(A, "still down", T0)  # no change: nothing new to write
    # j0 still holds A (its follow re-attaches); the line waits for B.
    assert set(line.state.holders) == {"j0", "j1"}
    line.release("j0", T0)
    assert granted(line) == {}
    line.release("j1", T0)
    assert granted(line) == {"j2": B}
    view = {s.url: s for s in line.view(T0).servers}
    assert view[A].health == "unhealthy" and view[A].failures == 1
    assert view[A].last_error == "no answer to GET /queue"
    assert line.set_health(A, None, T0)
    ask(line, "j3")
    assert granted(line) == {"j3": A}


def test_a_drained_server_finishes_its_job_and_gets_no_new_one_until_undrained() -> None:
    line = PoolLine(QueueState(pool="farm"))
    for n in range(4):
        ask(line, f"j{n}")
    assert granted(line) == {"j0": A, "j1": B}
    line.drain(B, "ops", T0)
    line.release("j1", T0)
    assert granted(line) == {}
    assert {s.url: s.health for s in line.view(T0).servers} == {A: "healthy", B: "drained"}
    line.release("j0", T0)
    assert granted(line) == {"j2": A}
    line.drain(B, None, T0)
    assert granted(line) == {"j3": B}


def test_a_drained_pool_grants_nothing_and_counts_its_bound_again_after() -> None:
    line = PoolLine(QueueState(pool="farm"))
    line.drain(None, "ops", T0)
    ask(line, "j0")
    assert granted(line) == {} and line.view(T0).drained == "ops"
    line.drain(None, None, T0)
    assert granted(line) == {"j0": A}


def test_max_running_below_the_servers_slots_still_bounds_the_pool() -> None:
    line = PoolLine(QueueState(pool="farm"))
    for n in range(3):
        ask(line, f"j{n}", servers=(A, B, C), max_running=2)
    assert granted(line) == {"j0": A, "j1": B}
    assert line.free_slots() == 0


def test_a_pool_without_servers_grants_without_naming_one() -> None:
    line = PoolLine(QueueState(pool="one"))
    ask(line, "j0", servers=(), max_running=1)
    assert granted(line) == {"j0": None}
    assert line.view(T0).servers == []


def test_the_servers_and_their_states_survive_continue_as_new() -> None:
    line = PoolLine(QueueState(pool="farm"))
    for n in range(3):
        ask(line, f"j{n}")
    granted(line)
    line.drain(B, "ops", T0)
    carried = QueueState.model_validate_json(line.snapshot().model_dump_json())
    again = PoolLine(carried)
    assert again.server_loads() == {A: 1, B: 1}
    assert not again.takes_work(B)
    again.release("j0", T0)
    assert granted(again) == {"j2": A}


def endpoint(**fields: object) -> EndpointHealth:
    return EndpointHealth.model_validate(fields)


def runpod_ask(line: PoolLine, job_id: str, cold_start_s: float = 40.0) -> None:
    line.request(
        SlotRequest(
            job_id=job_id,
            tenant="t",
            max_running=1,
            accepted_at=T0,
            watch_endpoint=True,
            cold_start_s=cold_start_s,
        ),
        T0,
    )


def test_an_endpoint_no_worker_can_serve_grants_nothing_and_its_waiters_hear_why() -> None:
    line = PoolLine(QueueState(pool="rp"))
    runpod_ask(line, "j0")
    runpod_ask(line, "j1")
    assert granted(line) == {"j0": None}
    assert line.set_endpoint(endpoint(running=1, unhealthy="no worker can take a job"))
    assert not line.set_endpoint(endpoint(running=1, unhealthy="no worker can take a job"))
    line.release("j0", T0)
    assert granted(line) == {}
    place = line.admission_of("j1", T0)
    assert place is not None and place.unhealthy == "no worker can take a job"
    assert line.health_view().unhealthy == "no worker can take a job"
    assert line.places_of(["j1"]).unhealthy == "no worker can take a job"
    assert line.set_endpoint(endpoint(idle=1))
    assert granted(line) == {"j1": None}


def test_a_cold_endpoint_adds_its_cold_start_to_the_wait_and_says_so() -> None:
    line = PoolLine(QueueState(pool="rp"))
    runpod_ask(line, "j0", cold_start_s=40.0)
    runpod_ask(line, "j1", cold_start_s=40.0)
    granted(line)
    line.set_endpoint(endpoint(initializing=2, cold=True))
    place = line.admission_of("j1", T0)
    assert place is not None and place.eta_s == 40.0
    assert place.note == "cold start: about 40 s"
    assert "cold start: about 40 s" in place_in_line(place)
    assert line.health_view().eta_s == 40.0
    line.set_endpoint(endpoint(idle=1))
    warm = line.admission_of("j1", T0)
    assert warm is not None and warm.eta_s is None and warm.note is None


def test_every_server_unhealthy_makes_the_pool_unhealthy_but_a_drain_does_not() -> None:
    line = PoolLine(QueueState(pool="farm"))
    ask(line, "j0")
    line.drain(A, "ops", T0)
    line.drain(B, "ops", T0)
    assert line.unhealthy() is None  # an operator's drain is not a failure to route around
    line.drain(B, None, T0)
    line.set_health(B, "no answer", T0)
    reason = line.unhealthy()
    assert reason is not None and "no answer" in reason
