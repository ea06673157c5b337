"""The claim protocol (endpoint/claims.py, endpoint/lease.py) against a real S3: SeaweedFS with
its real conditional writes (If-None-Match / If-Match, 412)."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from endpoint.claims import Acquired, ClaimStore, Finished, HeldElsewhere, StoredClaim, fresh_claim
from endpoint.errors import ClaimConflict, ClaimError
from endpoint.lease import Lease
from endpoint.s3 import S3, Patience
from protocol.runpod.contract import (
    ArtifactRecord,
    Claim,
    ClaimOutcome,
    FenceRecord,
    PromptEnd,
    S3Target,
    claim_key,
)
from tests.support.endpoint import Bucket


@pytest.fixture
def store(bucket: Bucket) -> ClaimStore:
    return ClaimStore(S3(bucket.settings), bucket.name)


def new_key() -> str:
    return claim_key(S3Target(bucket="unused"), f"job-{uuid.uuid4().hex[:8]}", "sub-12345678")


def template(holder: str, worker: str = "worker-a") -> Claim:
    now = datetime.now(UTC)
    return Claim(
        submission="sub-12345678",
        job_id="job-1",
        prompt_id="prompt-1",
        holder=holder,
        worker_id=worker,
        lease_until=now,
        renewed_at=now,
    )


def outcome(state: str = "completed") -> ClaimOutcome:
    return ClaimOutcome.model_validate({"state": state, "at": datetime.now(UTC)})


async def wait_expired(store: ClaimStore, key: str, within: float = 8.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        current = await store.read(key)
        assert current is not None
        if current.expired:
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"{key} did not expire within {within}s")


def test_claim_key_sits_in_the_jobs_folder() -> None:
    key = claim_key(S3Target(bucket="b", prefix="jobs/x"), "job/1", "sub-1.2_3")
    assert key == f"jobs/x/{claim_key(S3Target(bucket='b', prefix=''), 'job/1', 'sub-1.2_3')}"
    assert key.endswith("/_claims/sub-1.2_3.json") and "job/1" not in key


async def test_first_claimer_creates_and_a_second_gets_412(store: ClaimStore) -> None:
    key = new_key()
    first = await store.acquire(key, template("rp-A"), lease_s=30, fence_after_s=0)
    assert isinstance(first, Acquired) and first.took_over is None
    assert first.held.claim.holder == "rp-A"
    assert first.held.claim.lease_until - first.held.claim.renewed_at == timedelta(seconds=30)

    with pytest.raises(ClaimConflict):  # the raw conditional create: If-None-Match: * -> 412
        await store.create(key, fresh_claim(template("rp-B"), 30))
    second = await store.acquire(
        key, template("rp-B", worker="worker-b"), lease_s=30, fence_after_s=0
    )
    assert isinstance(second, HeldElsewhere)
    assert second.current.claim.holder == "rp-A" and not second.current.expired
    assert second.current.etag == first.held.etag


async def test_renewal_moves_the_lease_and_a_stale_etag_is_refused(store: ClaimStore) -> None:
    key = new_key()
    acquired = await store.acquire(key, template("rp-A"), lease_s=30, fence_after_s=0)
    assert isinstance(acquired, Acquired)
    renewed = await store.renew(key, acquired.held, lease_s=30)
    assert renewed.etag != acquired.held.etag
    assert renewed.claim.renewed_at > acquired.held.claim.renewed_at
    current = await store.read(key)
    assert current is not None and current.claim == renewed.claim
    with pytest.raises(ClaimConflict):  # If-Match with the etag before the renewal -> 412
        await store.renew(key, acquired.held, lease_s=30)


async def test_an_expired_lease_is_taken_over_once(store: ClaimStore) -> None:
    key = new_key()
    old = await store.acquire(key, template("rp-A"), lease_s=1, fence_after_s=0)
    assert isinstance(old, Acquired)
    live = await store.acquire(
        key, template("rp-B", worker="worker-b"), lease_s=30, fence_after_s=0
    )
    assert isinstance(live, HeldElsewhere)  # not before it expired

    await wait_expired(store, key)
    taken = await store.acquire(
        key, template("rp-B", worker="worker-b"), lease_s=30, fence_after_s=0
    )
    assert isinstance(taken, Acquired)
    assert taken.took_over is not None and taken.took_over.holder == "rp-A"
    assert taken.held.claim.holder == "rp-B" and taken.held.claim.takeovers == 1
    # The old holder's next renewal learns it lost the claim.
    with pytest.raises(ClaimConflict):
        await store.renew(key, old.held, lease_s=1)


async def test_a_lapsed_lease_is_taken_over_only_once_it_ran_out_by_fence_after_s(
    store: ClaimStore,
) -> None:
    """The holder may be alive but silent: it stops its prompt by its lease's end, its
    watchdog soon after; only past fence_after_s is it surely fenced."""
    key = new_key()
    old = await store.acquire(key, template("rp-A"), lease_s=1, fence_after_s=3)
    assert isinstance(old, Acquired)
    await wait_expired(store, key)
    early = await store.acquire(key, template("rp-B", "worker-b"), lease_s=30, fence_after_s=3)
    assert isinstance(early, HeldElsewhere) and early.current.expired
    assert not early.current.takeable(3) and 0 < early.current.takeable_in_s(3) <= 3.5
    await asyncio.sleep(early.current.takeable_in_s(3) + 1.2)  # the server's whole seconds
    taken = await store.acquire(key, template("rp-B", "worker-b"), lease_s=30, fence_after_s=3)
    assert isinstance(taken, Acquired) and taken.took_over is not None


async def test_a_claim_whose_holder_recorded_its_fence_is_taken_over_at_once(
    store: ClaimStore,
) -> None:
    key = new_key()
    fence = FenceRecord(action="interrupted", at=datetime.now(UTC))
    await store.create(key, fresh_claim(template("rp-A").model_copy(update={"fenced": fence}), 60))
    taken = await store.acquire(key, template("rp-B", "worker-b"), lease_s=30, fence_after_s=30)
    assert isinstance(taken, Acquired)
    assert taken.took_over is not None and taken.took_over.fenced == fence
    assert taken.held.claim.fenced is None and taken.held.claim.holder == "rp-B"


@pytest.mark.parametrize("outcome", ["success", "interrupted"])
async def test_a_takeover_keeps_what_a_successful_prompt_left(
    store: ClaimStore, outcome: str
) -> None:
    key = new_key()
    end = PromptEnd.model_validate(
        {
            "outcome": outcome,
            "at": datetime.now(UTC),
            "outputs": [{"node_id": "7", "filename": "a"}],
        }
    )
    stored = [ArtifactRecord(filename="a", type="s3_url", data="s3://b/k", node_id="7", key="k")]
    fence = FenceRecord(action="ended", at=datetime.now(UTC))
    left = template("rp-A").model_copy(
        update={"prompt_end": end, "stored": stored, "fenced": fence}
    )
    await store.create(key, fresh_claim(left, 60))
    taken = await store.acquire(key, template("rp-B", "worker-b"), lease_s=30, fence_after_s=30)
    assert isinstance(taken, Acquired)
    claim = taken.held.claim
    if outcome == "success":
        assert claim.prompt_end == end and claim.stored == stored
    else:  # run again whole: nothing of it is kept
        assert claim.prompt_end is None and claim.stored == []
    current = await store.read(key)
    assert current is not None and current.claim == claim


async def test_expiry_is_judged_by_the_servers_clock_not_the_holders(store: ClaimStore) -> None:
    key = new_key()
    # A holder whose clock is an hour behind: by its stamps the lease ended long ago, yet the
    # object was written just now, so by the S3 server's clock it is live.
    skewed = datetime.now(UTC) - timedelta(hours=1)
    await store.create(key, fresh_claim(template("rp-A"), 30, now=skewed))
    current = await store.read(key)
    assert current is not None and not current.expired and current.lease_s == 30
    assert isinstance(
        await store.acquire(key, template("rp-B", "w-b"), 30, fence_after_s=0), HeldElsewhere
    )


async def test_the_same_job_on_the_same_worker_rejoins_a_live_claim(store: ClaimStore) -> None:
    key = new_key()
    first = await store.acquire(key, template("rp-A"), lease_s=30, fence_after_s=0)
    assert isinstance(first, Acquired)
    # A restarted handler process: same RunPod job, same worker. It takes the claim over at once.
    again = await store.acquire(key, template("rp-A"), lease_s=30, fence_after_s=0)
    assert isinstance(again, Acquired) and again.held.claim.takeovers == 1
    # The same job re-delivered to another worker is not the same handler: it must wait.
    other = await store.acquire(
        key, template("rp-A", worker="worker-b"), lease_s=30, fence_after_s=0
    )
    assert isinstance(other, HeldElsewhere)


async def test_a_takeover_names_the_holders_before_it_a_restart_does_not(
    store: ClaimStore,
) -> None:
    """What a redelivered RunPod job billed on its lost worker is read from `earlier`
    (activities/runpod/cost.py): every holder a takeover replaced, as its claim last said; a
    restarted handler of the same delivery is no new holder and keeps its claim's start."""
    key = new_key()
    start = datetime.now(UTC) - timedelta(seconds=20)
    first = template("rp-A").model_copy(update={"claimed_at": start})
    await store.create(key, fresh_claim(first, 60))
    restarted = await store.acquire(key, template("rp-A"), lease_s=60, fence_after_s=0)
    assert isinstance(restarted, Acquired)
    assert restarted.held.claim.claimed_at == start and restarted.held.claim.earlier == []
    lost = restarted.held.claim
    fence = FenceRecord(action="interrupted", at=datetime.now(UTC))
    await store.replace(key, lost.model_copy(update={"fenced": fence}), restarted.held.etag)
    redelivered = template("rp-A", worker="worker-b").model_copy(
        update={"claimed_at": datetime.now(UTC)}
    )
    taken = await store.acquire(key, redelivered, lease_s=60, fence_after_s=0)
    assert isinstance(taken, Acquired)
    [before] = taken.held.claim.earlier
    assert (before.holder, before.worker_id) == ("rp-A", "worker-a")
    assert before.claimed_at == start and before.lease_until == lost.lease_until
    assert taken.held.claim.claimed_at == redelivered.claimed_at
    renewed = await store.renew(key, taken.held, lease_s=60)
    assert renewed.claim.earlier == [before], "a renewal keeps them"
    assert renewed.claim.claimed_at == redelivered.claimed_at


async def test_an_outcome_is_final(store: ClaimStore, bucket: Bucket) -> None:
    key = new_key()
    acquired = await store.acquire(key, template("rp-A"), lease_s=1, fence_after_s=0)
    assert isinstance(acquired, Acquired)
    done = await store.finish(key, acquired.held, outcome("completed"))
    body_before, _ = bucket.read(key)

    with pytest.raises(ClaimConflict):
        await store.renew(key, acquired.held, lease_s=1)
    with pytest.raises(ClaimConflict):
        await store.finish(key, acquired.held, outcome("failed"))
    await asyncio.sleep(2.5)  # far past the 1 s lease: an outcome never expires
    for holder, worker in (("rp-B", "worker-b"), ("rp-A", "worker-a")):
        decision = await store.acquire(key, template(holder, worker), lease_s=30, fence_after_s=0)
        assert isinstance(decision, Finished)
        assert decision.current.claim.outcome is not None
        assert decision.current.claim.outcome.state == "completed"
        assert not decision.current.expired
    body_after, _ = bucket.read(key)
    current = await store.read(key)
    assert body_after == body_before and current is not None and current.etag == done.etag


async def test_concurrent_claimers_exactly_one_wins(store: ClaimStore, bucket: Bucket) -> None:
    key = new_key()
    stores = [ClaimStore(S3(bucket.settings), bucket.name) for _ in range(8)]
    # Each store's S3 client made first: made inside the race (a few hundred ms of CPU each on
    # a busy machine), the last claimers came late enough to find the first claim's lease run
    # out, and took it over lawfully.
    assert [await s.read(key) for s in stores] == [None] * len(stores)
    decisions = await asyncio.gather(
        *(
            s.acquire(key, template(f"rp-{i}", f"w-{i}"), 2, fence_after_s=0)
            for i, s in enumerate(stores)
        )
    )
    winners = [d for d in decisions if isinstance(d, Acquired)]
    assert len(winners) == 1
    winner = winners[0].held.claim.holder
    assert all(
        isinstance(d, HeldElsewhere) and d.current.claim.holder == winner
        for d in decisions
        if not isinstance(d, Acquired)
    )

    # And once it expired, of many takers exactly one takes it over.
    await wait_expired(store, key)
    decisions = await asyncio.gather(
        *(
            s.acquire(key, template(f"rp-t{i}", f"wt-{i}"), 30, fence_after_s=0)
            for i, s in enumerate(stores)
        )
    )
    takers = [d for d in decisions if isinstance(d, Acquired)]
    assert len(takers) == 1 and takers[0].took_over is not None
    assert takers[0].took_over.holder == winner


async def test_a_retried_write_that_had_landed_counts_as_ours(store: ClaimStore) -> None:
    """botocore retries a PUT whose answer was lost; the retry's 412 is against our own write."""
    key = new_key()
    claim = fresh_claim(template("rp-A"), 30)
    first = await store.create(key, claim)
    again = await store.create(key, claim)  # the "retry": same claim, 412, read back: ours
    assert again.etag == first.etag and again.claim == claim


async def test_the_lease_renews_and_notices_a_takeover(store: ClaimStore) -> None:
    key = new_key()
    acquired = await store.acquire(key, template("rp-A"), lease_s=30, fence_after_s=0)
    assert isinstance(acquired, Acquired)
    async with Lease(store, key, acquired.held, lease_s=0.6) as lease:
        await asyncio.sleep(0.7)  # renewals every 0.2 s
        renewed = lease.held
        assert renewed.etag != acquired.held.etag
        assert renewed.lease_s == pytest.approx(0.6)
        # Someone takes it over (as after an expiry): the next renewal's If-Match fails. The
        # taker reads again when a renewal lands between its read and its write, as one would.
        while True:
            current = await store.read(key)
            assert current is not None
            try:
                await store.replace(key, fresh_claim(template("rp-B", "w-b"), 30), current.etag)
                break
            except ClaimConflict:
                continue
        await asyncio.wait_for(lease.lost.wait(), timeout=3)
    assert lease.lost_to is not None and lease.lost_to.claim.holder == "rp-B"
    with pytest.raises(ClaimConflict):
        await lease.finish(outcome())


async def test_the_lease_finishes_with_the_outcome(store: ClaimStore) -> None:
    key = new_key()
    acquired = await store.acquire(key, template("rp-A"), lease_s=30, fence_after_s=0)
    assert isinstance(acquired, Acquired)
    async with Lease(store, key, acquired.held, lease_s=0.3) as lease:
        await asyncio.sleep(0.35)
        finished = await lease.finish(outcome("cancelled"))
        await asyncio.sleep(0.3)  # no renewal after the outcome
    current = await store.read(key)
    assert current is not None and current.etag == finished.etag
    assert current.claim.outcome is not None and current.claim.outcome.state == "cancelled"
    assert not lease.lost.is_set()


class LosingAnswers(ClaimStore):
    """A store whose next conditional write lands but whose answer is lost on the way back."""

    lose_next = False

    async def replace(
        self, key: str, claim: Claim, etag: str, *, patience: Patience | None = None
    ) -> StoredClaim:
        stored = await super().replace(key, claim, etag, patience=patience)
        if self.lose_next:
            self.lose_next = False
            raise ClaimError("connection reset before the answer")
        return stored


async def test_a_renewal_that_landed_without_an_answer_is_still_ours(bucket: Bucket) -> None:
    """The next renewal's 412 is against our own write: the lease goes on, not lost."""
    store = LosingAnswers(S3(bucket.settings), bucket.name)
    key = new_key()
    acquired = await store.acquire(key, template("rp-A"), lease_s=30, fence_after_s=0)
    assert isinstance(acquired, Acquired)
    async with Lease(store, key, acquired.held, lease_s=0.6) as lease:
        store.lose_next = True
        await asyncio.sleep(1.2)  # the lost renewal and a few after it
        assert not lease.lost.is_set()
        # Compared once renewal has stopped: a renewal may land between a read and a look at
        # `lease.held`. A lease that had lost the claim could not finish it.
        finished = await lease.finish(outcome("completed"))
    current = await store.read(key)
    assert current is not None and current.etag == finished.etag
    assert current.claim.holder == "rp-A" and current.claim.outcome is not None


async def test_marking_the_stop_writes_stopping_since_at_once_and_keeps_it(
    store: ClaimStore,
) -> None:
    key = new_key()
    acquired = await store.acquire(key, template("rp-A"), lease_s=30, fence_after_s=0)
    assert isinstance(acquired, Acquired)
    async with Lease(store, key, acquired.held, lease_s=30) as lease:  # renewals 10 s apart
        since = datetime.now(UTC)
        lease.mark_stopping(since)
        deadline = time.monotonic() + 3
        while (
            current := await store.read(key)
        ) is not None and current.claim.stopping_since is None:
            assert time.monotonic() < deadline, "stopping_since was not written"
            await asyncio.sleep(0.05)
        assert current is not None and current.claim.stopping_since == since
        assert current.claim.renewed_at > acquired.held.claim.renewed_at  # a renewal
        await lease.finish(outcome("cancelled"))
    current = await store.read(key)
    assert current is not None and current.claim.stopping_since == since
    assert current.claim.outcome is not None and current.claim.outcome.state == "cancelled"
