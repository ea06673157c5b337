"""The queue's rule on its own (workflows/admission.py): the bound, priorities, fair shares
between tenants, first come first served within one, and the places it tells."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from workflows.admission import (
    MAX_LINE,
    PoolLine,
    QueueState,
    SlotRequest,
    SlotUnsettled,
    worth_telling,
)

T0 = datetime(2026, 12, 7, tzinfo=UTC)


def ask(
    line: PoolLine,
    job_id: str,
    *,
    tenant: str = "a",
    priority: int = 3,
    weight: float = 1.0,
    max_running: int = 1,
    tenant_max_pending: int | None = None,
) -> None:
    line.request(
        SlotRequest(
            job_id=job_id,
            tenant=tenant,
            priority=priority,
            weight=weight,
            max_running=max_running,
            accepted_at=T0,
            tenant_max_pending=tenant_max_pending,
        ),
        T0,
    )


def start_one(line: PoolLine, now: datetime = T0) -> str:
    """Free the one slot (if held) and grant it: the id of the job that starts next."""
    for job_id in list(line.state.holders):
        line.release(job_id, now)
    [granted] = line.grants(now)
    return granted.job_id


def starts(line: PoolLine, count: int) -> list[str]:
    return [start_one(line) for _ in range(count)]


def test_no_more_than_max_running_hold_the_pool_and_a_release_lets_the_next_in() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(5):
        ask(line, f"j{n}", max_running=2)
    assert [h.job_id for h in line.grants(T0)] == ["j0", "j1"]
    assert line.grants(T0) == [] and len(line.state.holders) == 2
    assert line.release("j0", T0 + timedelta(seconds=10))
    assert [h.job_id for h in line.grants(T0)] == ["j2"]
    assert line.state.recent_holds_s == [10.0]


def test_a_repeated_request_changes_nothing() -> None:
    line = PoolLine(QueueState(pool="p"))
    ask(line, "j0")
    ask(line, "j1")
    ask(line, "j0")
    assert line.waiting == 2
    line.grants(T0)
    ask(line, "j0")  # a holder asking again stays a holder, not in line
    assert line.waiting == 1 and "j0" in line.state.holders


def test_within_one_tenant_first_come_first_served() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(6):
        ask(line, f"j{n}")
    assert starts(line, 6) == [f"j{n}" for n in range(6)]


@pytest.mark.parametrize(("weight", "within"), [(1.0, 12), (2.0, 9)])
def test_a_second_tenant_gets_its_share_at_once_behind_a_first_tenants_batch(
    weight: float, within: int
) -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(60):
        ask(line, f"a{n}", tenant="a")
    starts(line, 5)  # tenant A's batch is running
    for n in range(6):
        ask(line, f"b{n}", tenant="b", weight=weight)
    following = starts(line, within)
    assert [j for j in following if j.startswith("b")] == [f"b{n}" for n in range(6)]


@pytest.mark.parametrize(("weights", "share"), [((1.0, 1.0), 0.5), ((2.0, 1.0), 2 / 3)])
def test_shares_over_every_window_of_100_starts_follow_the_weights(
    weights: tuple[float, float], share: float
) -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(600):
        ask(line, f"a{n}", tenant="a", weight=weights[0])
        ask(line, f"b{n}", tenant="b", weight=weights[1])
    started = starts(line, 600)
    for first in range(0, 500):
        window = started[first : first + 100]
        a_share = sum(1 for j in window if j.startswith("a")) / 100
        assert abs(a_share - share) <= 0.05, (first, a_share)


def test_a_better_priority_starts_at_the_next_free_slot() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(1000):
        ask(line, f"j{n}")
    line.grants(T0)
    ask(line, "urgent", tenant="b", priority=1)
    assert start_one(line) == "urgent"
    # and a worse priority waits behind everything else
    ask(line, "later", priority=5)
    assert "later" not in starts(line, 999)
    assert start_one(line) == "later"


def test_a_tenant_that_was_idle_earns_no_credit_to_flood_with() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(40):
        ask(line, f"a{n}", tenant="a")
    ask(line, "b0", tenant="b")
    starts(line, 20)  # B's one job ran early; B then had nothing waiting
    for n in range(1, 11):
        ask(line, f"b{n}", tenant="b")
    following = starts(line, 10)
    # Back at the last start's pass: B alternates with A, it does not take all ten.
    assert sum(1 for j in following if j.startswith("b")) == 5


def test_positions_are_the_order_the_jobs_start_in() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(8):
        ask(line, f"a{n}", tenant="a")
    for n in range(3):
        ask(line, f"b{n}", tenant="b", weight=2.0)
    ask(line, "c0", tenant="c", priority=2)
    line.grants(T0)
    told = {a.job_id: a.position or 0 for a in line.positions(T0)}
    admission = line.admission_of("b1", T0)
    assert admission is not None and admission.position == told["b1"]
    assert admission.ahead == told["b1"] - 1 and admission.waiting == 11
    order = sorted(told, key=lambda j: told[j])
    assert starts(line, 11) == order


def test_a_job_that_leaves_the_line_gives_its_place_back() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(4):
        ask(line, f"j{n}")
    line.grants(T0)
    assert line.release("j2", T0)
    assert starts(line, 2) == ["j1", "j3"]
    # A release of a job the queue does not have changes nothing.
    assert not line.release("ghost", T0)
    assert line.waiting == 0 and len(line.state.holders) == 1


def test_an_unsettled_holder_keeps_its_slot_until_its_settle_time() -> None:
    line = PoolLine(QueueState(pool="p"))
    ask(line, "j0")
    ask(line, "j1")
    line.grants(T0)
    settle_at = T0 + timedelta(minutes=5)
    assert line.unsettled(SlotUnsettled(job_id="j0", settle_at=settle_at))
    assert line.grants(T0) == [] and line.settle_due(T0) == []
    assert line.next_settle_at() == settle_at
    assert line.settle_due(settle_at) == ["j0"]
    line.release("j0", settle_at)
    assert [h.job_id for h in line.grants(settle_at)] == ["j1"]
    # An unsettled hold says nothing about how long the pool's jobs take.
    assert line.state.recent_holds_s == []


def test_the_queue_carried_into_a_new_run_is_the_same_queue() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(10):
        ask(line, f"a{n}", tenant="a")
        ask(line, f"b{n}", tenant="b", weight=2.0)
    starts(line, 4)
    carried = QueueState.model_validate_json(line.snapshot().model_dump_json())
    again = PoolLine(carried)
    assert [a.job_id for a in again.positions(T0)] == [a.job_id for a in line.positions(T0)]
    assert starts(again, 16) == starts(line, 16)


def test_the_eta_is_the_place_times_a_recent_hold_over_the_bound() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(6):
        ask(line, f"j{n}", max_running=2)
    line.grants(T0)
    line.release("j0", T0 + timedelta(seconds=60))
    line.release("j1", T0 + timedelta(seconds=60))
    line.grants(T0 + timedelta(seconds=60))
    admission = line.admission_of("j5", T0)
    assert admission is not None and admission.position == 2
    assert admission.eta_s == 60.0  # 60 s per hold over 2 slots: 30 s per start


def test_a_tenant_at_its_max_pending_has_no_room_and_is_told_when_to_come_back() -> None:
    line = PoolLine(QueueState(pool="p"))
    ask(line, "j0", tenant_max_pending=2)
    line.grants(T0)
    line.release("j0", T0 + timedelta(seconds=40))  # one hold of 40 s: 40 s per start
    for n in range(1, 4):
        ask(line, f"j{n}", tenant_max_pending=2)
    line.grants(T0)
    assert line.waiting == 2
    room = line.room("a")
    assert room.full and room.limit == 2 and room.waiting == 2
    assert room.retry_after_s == 40.0 and "max_pending is 2" in room.reason
    assert not line.room("b").full  # another tenant has room
    # What still fits: the tighter of the tenant's bound and the pool's; for a tenant the
    # queue never heard from, unknown (its bound may be one the queue has not heard).
    assert line.room("b").headroom is None
    ask(line, "b1", tenant="b")
    assert line.room("b").headroom == MAX_LINE - 3
    line.release("j3", T0)
    assert line.room("a").headroom == 1


def test_a_pool_at_its_max_pending_has_room_for_nobody() -> None:
    line = PoolLine(QueueState(pool="p"))
    for n in range(4):
        line.request(
            SlotRequest(
                job_id=f"j{n}",
                tenant=f"t{n}",
                max_running=1,
                accepted_at=T0,
                pool_max_pending=3,
            ),
            T0,
        )
    line.grants(T0)
    room = line.room("someone")
    assert room.full and "pool 'p'" in room.reason and room.retry_after_s is None


def test_a_line_never_holds_more_than_its_payload_allows() -> None:
    line = PoolLine(QueueState(pool="p"))
    long_id = "j" * 190  # job ids are up to 200 characters
    for n in range(1000):  # the most holders a pool may have (max_running)
        ask(line, f"{long_id}-h{n}", tenant=f"t{n % 7}", max_running=1000)
    line.grants(T0)
    for n in range(MAX_LINE):
        ask(line, f"{long_id}-{n}", tenant=f"t{n % 7}", max_running=1000)
    room = line.room("newcomer")
    assert room.full and room.limit == MAX_LINE
    # Carried whole into the next run: one payload, under Temporal's 2 MiB.
    assert len(line.snapshot().model_dump_json()) < 2 * 1024 * 1024


def test_a_waiting_job_hears_its_place_when_it_halved_or_among_the_last_three() -> None:
    told: int | None = None
    heard = []
    for position in range(50, 0, -1):  # a line that moves by one at each start
        if worth_telling(told, position):
            heard.append(position)
            told = position
    assert heard == [50, 25, 12, 6, 3, 2, 1]
    assert worth_telling(5, 10) and not worth_telling(5, 9)  # pushed back twice as far
    assert not worth_telling(7, 7)


def watching(job_id: str, *, in_follow: bool = True) -> SlotRequest:
    return SlotRequest(
        job_id=job_id, tenant="a", max_running=1, accepted_at=T0, in_follow=in_follow
    )


def test_a_follow_waiting_in_line_is_watched_through_its_grant_until_it_stops_watching() -> None:
    line = PoolLine(QueueState(pool="p"))
    line.request(watching("held"), T0)
    line.request(watching("next"), T0)
    ask(line, "loud")
    assert [h.job_id for h in line.grants(T0)] == ["held"]
    # A follow that watches is told nothing by signal: the queue knows it, held or waiting.
    assert line.watched("held") and line.watched("next") and not line.watched("loud")
    line.release("held", T0)
    [granted] = line.grants(T0)
    assert granted.job_id == "next" and granted.in_follow
    # Its follow stopped watching (it waited its time): asked again without, told by signal.
    line.request(watching("next", in_follow=False), T0)
    assert not line.watched("next")


def test_the_places_of_some_waiting_jobs_leave_out_those_not_waiting() -> None:
    line = PoolLine(QueueState(pool="p", recent_holds_s=[10.0]))
    for job_id in ("first", "second", "third"):
        line.request(watching(job_id), T0)
    line.grants(T0)
    places = line.places_of(["third", "first", "unknown"])
    # "first" holds the slot: neither placed nor waiting.
    assert places.places == {"third": 2} and places.waiting == 2
    assert places.per_start_s == 10.0
    # Carried across continue-as-new: the next run knows who watches.
    carried = PoolLine(QueueState.model_validate(line.snapshot().model_dump(mode="json")))
    assert carried.watched("second") and carried.watched("first")
