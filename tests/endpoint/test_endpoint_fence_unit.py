"""The handler's fence without any server: when the lease says it must fence (endpoint/lease.py),
what the fence file says (endpoint/fence_file.py), how the fence is recorded, and what a
delivery that takes a claim over still has to run (endpoint/takeover.py). The claim store is an
in-memory fake whose writes can fail as in an outage, or answer late."""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from endpoint.claims import ClaimStore, StoredClaim, fresh_claim
from endpoint.errors import ClaimConflict, ClaimError
from endpoint.fence_file import FenceFile, FenceState, read_fence
from endpoint.fencing import Fenced, fence_action, fenced_error
from endpoint.lease import WRITE_GAP_S, Lease, fence_margin_s
from endpoint.s3 import Patience
from endpoint.takeover import recorded_end, what_is_left, with_kept
from protocol.comfyui.follower import PromptEnd as FollowedEnd
from protocol.runpod.contract import (
    ArtifactRecord,
    Claim,
    ClaimOutcome,
    FenceRecord,
    OutputFile,
    PromptEnd,
)

KEY = "jobs/job-1/_claims/sub-12345678.json"


class MemoryStore(ClaimStore):
    """One claim in memory. `failing`: every write fails as in an outage (nothing lands);
    `answer_after_s`: a write lands at once and its answer comes that much later."""

    def __init__(self, claim: Claim) -> None:
        self.bucket = "memory"
        self.claim = claim
        self.version = 1
        self.failing = False
        self.answer_after_s = 0.0
        # (sent, landed) time.monotonic() of each write that landed, and its claim.
        self.writes: list[tuple[float, float, Claim]] = []
        self.patiences: list[float] = []

    @property
    def etag(self) -> str:
        return f'"v{self.version}"'

    @property
    def retry_s(self) -> float:
        return 300.0

    async def read(self, key: str) -> StoredClaim | None:
        return StoredClaim(self.claim, self.etag)

    async def replace(
        self, key: str, claim: Claim, etag: str, *, patience: Patience | None = None
    ) -> StoredClaim:
        sent = time.monotonic()
        if patience is not None:
            self.patiences.append(patience.budget_s)
        if self.failing:
            raise ClaimError("storage is down")
        if etag != self.etag:
            raise ClaimConflict("someone else wrote it")
        self.claim, self.version = claim, self.version + 1
        self.writes.append((sent, time.monotonic(), claim))
        stored = StoredClaim(claim, self.etag, sent_at=sent)
        if self.answer_after_s:
            await asyncio.sleep(self.answer_after_s)
        return stored

    def taken_by(self, holder: str) -> None:
        """Someone else's conditional write wins."""
        self.claim = self.claim.model_copy(update={"holder": holder})
        self.version += 1


def held_claim(lease_s: float) -> tuple[MemoryStore, StoredClaim]:
    now = datetime.now(UTC)
    claim = fresh_claim(
        Claim(
            submission="sub-12345678",
            job_id="job-1",
            prompt_id="prompt-1",
            holder="rp-A",
            worker_id="worker-a",
            lease_until=now,
            renewed_at=now,
        ),
        lease_s,
    )
    store = MemoryStore(claim)
    return store, StoredClaim(claim, store.etag, sent_at=time.monotonic())


def record(node: str, name: str) -> ArtifactRecord:
    key = f"jobs/job-1/0/{node}/{name}"
    return ArtifactRecord(
        filename=name,
        type="s3_url",
        data=f"s3://b/{key}",
        node_id=node,
        size=1,
        sha256="0" * 64,
        bucket="b",
        key=key,
    )


async def fence_time(lease: Lease) -> float:
    await asyncio.wait_for(lease.fence_due.wait(), timeout=30)
    return time.monotonic()


# --- when the holder fences ----------------------------------------------------------------


def test_the_margin_is_a_quarter_of_the_lease_at_most_ten_seconds() -> None:
    assert fence_margin_s(60.0) == 10.0
    assert fence_margin_s(6.0) == 1.5
    assert fence_margin_s(400.0) == 10.0


async def test_a_lease_that_renews_never_fences() -> None:
    store, held = held_claim(2.0)
    async with Lease(store, KEY, held, 2.0) as lease:
        await asyncio.sleep(4.5)  # more than two leases: renewed every 0.67 s
        assert not lease.fence_due.is_set()
    assert len(store.writes) >= 5


async def test_the_fence_comes_a_margin_before_the_lease_ends_counted_from_the_last_send() -> None:
    """Renewals land at once but their answers come 0.5 s late: the lease runs from when the
    last successful one was sent, not from its answer; with S3 gone the fence comes at that
    send plus the lease less the margin (2.0 - 0.5 s), not before and not later."""
    store, held = held_claim(2.0)
    store.answer_after_s = 0.5
    async with Lease(store, KEY, held, 2.0) as lease:
        await asyncio.sleep(1.5)  # a renewal every 0.67 s (plus its slow answer)
        store.failing = True
        fenced_at = await fence_time(lease)
        last_sent, last_landed, _ = store.writes[-1]
        assert lease.margin_s == 0.5
        assert lease.fence_at == pytest.approx(last_sent + 1.5, abs=1e-6)
        assert lease.ends_at == pytest.approx(last_sent + 2.0, abs=1e-6)
        assert last_sent + 1.5 <= fenced_at < last_sent + 1.5 + 0.2
        # Not from the answer, which came half a second after it was sent.
        assert fenced_at < last_landed + store.answer_after_s + 1.5 - 0.3
        writes = len(store.writes)
        await asyncio.sleep(0.5)
    assert len(store.writes) == writes  # no renewal once the fence is due


async def test_the_fence_file_says_until_when_the_claim_is_surely_ours(tmp_path: Path) -> None:
    path = tmp_path / "fence.json"
    store, held = held_claim(2.0)
    async with Lease(store, KEY, held, 2.0, fence_after_s=7.0, fence_file=FenceFile(path)) as lease:
        await asyncio.sleep(0.9)  # a renewal
        state = read_fence(path)
        assert state is not None and state.holding
        assert (state.pid, state.submission, state.prompt_id) == (
            os.getpid(),
            "sub-12345678",
            "prompt-1",
        )
        assert (state.lease_s, state.fence_after_s) == (2.0, 7.0)
        # Epoch seconds: the last send plus the lease less the margin.
        assert state.fence_by == pytest.approx(
            time.time() + lease.fence_at - time.monotonic(), abs=0.05
        )
        store.failing = True
        await fence_time(lease)
        fencing = read_fence(path)
        # While fencing: until the lease's end.
        assert fencing is not None and fencing.holding
        assert fencing.fence_by == pytest.approx(
            time.time() + lease.ends_at - time.monotonic(), abs=0.05
        )
    assert read_fence(path) == FenceState(holding=False)
    assert json.loads(path.read_text()) == {"holding": False}
    assert os.listdir(tmp_path) == ["fence.json"]  # no temporary left


def test_a_fence_file_that_is_missing_or_not_ours_holds_nothing(tmp_path: Path) -> None:
    assert read_fence(tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert read_fence(tmp_path / "bad.json") is None
    FenceFile(tmp_path / "deeper" / "f.json").released()
    assert read_fence(tmp_path / "deeper" / "f.json") == FenceState(holding=False)


async def test_news_is_written_at_once_and_a_burst_in_few_writes() -> None:
    store, held = held_claim(30.0)  # renewals 10 s apart: every write here is news
    async with Lease(store, KEY, held, 30.0) as lease:
        lease.prompt_ended(PromptEnd(outcome="success", at=datetime.now(UTC)))
        await asyncio.sleep(0.3)
        assert len(store.writes) == 1 and store.claim.prompt_end is not None
        for index in range(10):
            lease.output_stored(record("7", f"{index}.png"))
            await asyncio.sleep(0.1)
        lease.output_stored(record("7", "0.png"))  # the same output again: once
        await asyncio.sleep(1.5)
    assert 2 <= len(store.writes) <= 4
    assert [r.filename for r in store.claim.stored] == [f"{i}.png" for i in range(10)]


async def test_the_prompts_end_is_not_held_behind_the_gap_between_writes() -> None:
    """An output stored a moment before the prompt's end was just written; the end goes out at
    once all the same (a worker lost now leaves a finished run, not one to run again), while
    another output waits out WRITE_GAP_S."""
    store, held = held_claim(30.0)
    async with Lease(store, KEY, held, 30.0) as lease:
        lease.output_stored(record("7", "a.png"))
        await asyncio.sleep(0.1)
        assert len(store.writes) == 1
        lease.prompt_ended(PromptEnd(outcome="success", at=datetime.now(UTC)))
        await asyncio.sleep(WRITE_GAP_S / 2)
        assert len(store.writes) == 2 and store.claim.prompt_end is not None
        lease.output_stored(record("9", "b.png"))
        await asyncio.sleep(WRITE_GAP_S / 4)
        assert len(store.writes) == 2, "an output is still held behind the gap"
        await asyncio.sleep(WRITE_GAP_S)
        assert len(store.writes) == 3


async def test_caught_up_returns_once_the_claim_holds_what_was_said() -> None:
    """What the handler's progress waits for: an output stored just after a write is in the
    claim when `caught_up` returns, WRITE_GAP_S later, or at once when asked to be."""
    store, held = held_claim(30.0)
    async with Lease(store, KEY, held, 30.0) as lease:
        assert await lease.caught_up(), "nothing said: nothing to wait for"
        lease.output_stored(record("7", "a.png"))
        await asyncio.sleep(0.1)
        lease.output_stored(record("9", "b.png"))
        began = time.monotonic()
        assert await lease.caught_up()
        assert [r.filename for r in store.claim.stored] == ["a.png", "b.png"]
        assert time.monotonic() - began > WRITE_GAP_S / 2, "held behind the gap"
        lease.output_stored(record("11", "c.png"))
        began = time.monotonic()
        assert await lease.caught_up(at_once=True)
        assert time.monotonic() - began < WRITE_GAP_S / 2
        assert [r.filename for r in store.claim.stored] == ["a.png", "b.png", "c.png"]


async def test_caught_up_is_false_when_renewal_ends_before_the_claim_holds_it() -> None:
    """Through an outage `caught_up` waits for renewal to end, unless asked for a write at once:
    then the first failed write is the answer."""
    store, held = held_claim(30.0)
    async with Lease(store, KEY, held, 30.0) as lease:
        store.failing = True
        lease.output_stored(record("7", "a.png"))
        waiting = asyncio.create_task(lease.caught_up())
        assert await asyncio.wait_for(lease.caught_up(at_once=True), timeout=0.5) is False
        await asyncio.sleep(1.5)
        assert not waiting.done(), "renewal goes on through the outage: still waiting"
        await lease.stop()
        assert await waiting is False
        assert await lease.caught_up() is False, "nobody renews any more"


async def test_the_finish_never_outlasts_the_fence_point() -> None:
    store, held = held_claim(4.0)
    async with Lease(store, KEY, held, 4.0) as lease:
        store.failing = True
        await asyncio.sleep(1.0)
        left = lease.fence_at - time.monotonic()
        with pytest.raises(ClaimError):
            await lease.finish(ClaimOutcome(state="completed", at=datetime.now(UTC)))
    assert 0 < store.patiences[-1] <= left


# --- recording the fence --------------------------------------------------------------------


async def test_the_fence_is_recorded_once_storage_is_back_with_no_lease_left() -> None:
    store, held = held_claim(2.0)
    stored = record("7", "a.png")
    async with Lease(store, KEY, held, 2.0, fence_after_s=10.0) as lease:
        lease.output_stored(stored)
        await asyncio.sleep(0.2)
        store.failing = True
        await fence_time(lease)
        fence = FenceRecord(action="interrupted", at=datetime.now(UTC), worker_id="worker-a")
        recording = asyncio.create_task(lease.record_fence(fence))
        await asyncio.sleep(1.5)
        assert not recording.done()  # through the outage
        store.failing = False
        assert await asyncio.wait_for(recording, timeout=5) is True
    claim = store.claim
    assert claim.fenced == fence and claim.outcome is None
    assert claim.lease_until == claim.renewed_at  # may be taken over at once
    assert claim.stored == [stored]


async def test_a_fence_after_a_takeover_is_not_recorded() -> None:
    store, held = held_claim(2.0)
    async with Lease(store, KEY, held, 2.0) as lease:
        store.failing = True
        await fence_time(lease)
        store.failing = False
        store.taken_by("rp-B")
        fence = FenceRecord(action="interrupted", at=datetime.now(UTC))
        assert await asyncio.wait_for(lease.record_fence(fence), timeout=5) is False
    assert store.claim.holder == "rp-B" and store.claim.fenced is None


async def test_the_fence_is_given_up_once_anyone_may_take_the_claim_over() -> None:
    store, held = held_claim(2.0)
    async with Lease(store, KEY, held, 2.0, fence_after_s=1.5) as lease:
        store.failing = True
        await fence_time(lease)
        fence = FenceRecord(action="dequeued", at=datetime.now(UTC))
        recorded = await asyncio.wait_for(lease.record_fence(fence), timeout=10)
        gave_up_at = time.monotonic()
    assert recorded is False
    assert lease.ends_at + 1.5 - 1.0 <= gave_up_at <= lease.ends_at + 1.5 + 0.5


@pytest.mark.parametrize(
    ("fate", "ended_before", "action"),
    [
        ("interrupted", False, "interrupted"),
        ("dequeued", False, "dequeued"),
        ("never_submitted", False, "never_submitted"),
        ("finished", False, "ended"),
        ("failed", False, "ended"),
        ("gone", False, "ended"),
        ("still_running", False, "still_running"),
        ("finished", True, "ended"),
        ("interrupted", True, "ended"),
    ],
)
def test_what_the_fence_did(fate: Any, ended_before: bool, action: str) -> None:
    assert fence_action(fate, ended_before=ended_before) == action


def test_a_fenced_delivery_answers_promptlost_saying_it_fenced() -> None:
    fence = FenceRecord(action="interrupted", at=datetime.now(UTC))
    error = fenced_error(Fenced(fence, recorded=True, since_renewal_s=45.0))
    assert error.error_type == "PromptLost"
    assert error.details == ["fenced: interrupted"]
    assert "fenced itself" in error.error and "not finished" in error.error


# --- what a takeover still has to run -----------------------------------------------------------


GRAPH: dict[str, Any] = {
    "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 8, "height": 8}},
    "6": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0]}},
    "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "a"}},
    "8": {"class_type": "SimLargeOutput", "inputs": {"size_mib": 1, "filename_prefix": "b"}},
}


def claim_with(end: PromptEnd | None, stored: list[ArtifactRecord]) -> Claim:
    _, held = held_claim(10.0)
    return held.claim.model_copy(update={"prompt_end": end, "stored": stored})


def success(*names: tuple[str, str]) -> PromptEnd:
    outputs = [OutputFile(node_id=node, filename=name) for node, name in names]
    return PromptEnd(outcome="success", at=datetime.now(UTC), outputs=outputs)


def test_without_a_successful_prompt_the_whole_graph_runs() -> None:
    for end in (None, PromptEnd(outcome="interrupted", at=datetime.now(UTC))):
        left = what_is_left(claim_with(end, [record("7", "a.png")]), GRAPH)
        assert left.graph == GRAPH and not left.done and left.kept == []


def test_every_output_stored_leaves_nothing_to_run() -> None:
    a, b1, b2 = record("7", "a.png"), record("8", "b1.bin"), record("8", "b2.bin")
    end = success(("8", "b1.bin"), ("7", "a.png"), ("8", "b2.bin"))
    left = what_is_left(claim_with(end, [a, b2, b1, record("7", "stale.png")]), GRAPH)
    assert left.done and left.graph == {}
    assert left.kept == [b1, a, b2]  # as listed; a record of a file not listed is not counted


def test_a_partly_stored_prompt_runs_only_the_output_nodes_missing_something() -> None:
    a, b1 = record("7", "a.png"), record("8", "b1.bin")
    end = success(("7", "a.png"), ("8", "b1.bin"), ("8", "b2.bin"))
    left = what_is_left(claim_with(end, [a, b1]), GRAPH)
    assert not left.done and left.dropped == ("7",)
    assert left.graph == {k: v for k, v in GRAPH.items() if k != "7"}
    assert left.kept == [a] and left.kept_outputs == [end.outputs[0]]


def test_a_stored_output_node_another_node_reads_from_runs_again() -> None:
    graph = GRAPH | {"9": {"class_type": "ImageInvert", "inputs": {"image": ["7", 0]}}}
    end = success(("7", "a.png"), ("8", "b.bin"))
    left = what_is_left(claim_with(end, [record("7", "a.png")]), graph)
    assert left.graph == graph and left.dropped == () and left.kept == []


def test_the_recorded_end_lists_the_outputs_after_those_kept() -> None:
    entry = {
        "outputs": {
            "8": {"files": [{"filename": "b.bin", "subfolder": "s", "type": "output"}]},
            "9": {"images": [{"filename": "p.png", "subfolder": "", "type": "temp"}]},
        },
        "status": {"status_str": "success", "messages": []},
    }
    kept = [OutputFile(node_id="7", filename="a.png")]
    end = recorded_end(FollowedEnd("success", entry), kept)
    assert end.outcome == "success"
    assert end.outputs == [*kept, OutputFile(node_id="8", filename="b.bin", subfolder="s")]
    failed = recorded_end(FollowedEnd("error", entry), kept)
    assert failed.outcome == "error" and failed.outputs == []


def test_a_result_holds_the_kept_records_then_the_new_ones_each_once() -> None:
    a, b = record("7", "a.png"), record("8", "b.bin")
    assert with_kept([a], [a, b]) == [a, b]
    assert with_kept([], [b]) == [b]
