"""Names shared by the workflow, the activities, the worker, the clients and the tests.

One place for task queues, message names, search attributes and error types, so no string is
spelled twice; and the one reconnect delay that the workflow's durable timers, the clients and
the RunPod client all back off by.
"""

from __future__ import annotations

import re
from typing import Final

from temporalio.common import SearchAttributeKey

WORKFLOW_TYPE: Final = "InferenceJob"
DEFAULT_TASK_QUEUE: Final = "durable-comfy"

# Messages
QUERY_STATUS: Final = "status"
# The journal after a seq, with the status (`JobEvents`): what the gateway replays.
QUERY_EVENTS: Final = "events"
SIGNAL_PROGRESS: Final = "progress"
SIGNAL_CLIENT_SEEN: Final = "client_seen"
SIGNAL_CANCEL: Final = "cancel"
SIGNAL_RESUME: Final = "resume"
# Records the reason for a Temporal cancel that follows it (the job then ends Canceled).
SIGNAL_CANCEL_REASON: Final = "cancel_reason"
UPDATE_ATTACH: Final = "attach"
# Answers with the status once it is terminal (at once when it is): the job may still be
# delivering its last webhooks, but a client waiting for its end need not wait for those.
UPDATE_ENDED: Final = "ended"
# `resume` as an update: refused with a reason unless the job is NEEDS_DECISION; answers with
# the status once the job acted on it.
UPDATE_RESUME: Final = "resume"

# Our queue in front of a bounded pool (workflows/pool_queue.py): one dispatcher workflow per
# pool and task queue; a job's check asks it by the update `ask` (answered at once: the grant or
# a place in line), or by the signal `request`; jobs send it `release` and `unsettled`; it tells
# a waiting job its place and its grant by the signal `admission`.
POOL_QUEUE_WORKFLOW_TYPE: Final = "PoolQueue"
SIGNAL_SLOT_REQUEST: Final = "request"
SIGNAL_SLOT_RELEASE: Final = "release"
SIGNAL_SLOT_UNSETTLED: Final = "unsettled"
SIGNAL_ADMISSION: Final = "admission"
UPDATE_SLOT_ASK: Final = "ask"
QUERY_POOL_QUEUE: Final = "queue"
QUERY_ADMISSION: Final = "admission"
# What a follow waiting in line watches: who holds a slot, and the places of its jobs.
QUERY_SLOT_HOLDERS: Final = "holders"
QUERY_LINE_PLACES: Final = "places"
# How long a follow whose check was told a place in line waits for the grant itself before
# it hands the wait to its job (activities/backend.py).
FOLLOW_WAITS_IN_LINE_S: Final = 600.0
# Whether a tenant's new job may join the line (its `max_pending`, the pool's).
QUERY_ROOM: Final = "room"
# `pool drain` / `pool undrain`: no new job for a server of the pool, or the whole pool.
UPDATE_POOL_DRAIN: Final = "drain"
# Whether a pool takes work and how long a new job would wait (a group's check asks it).
QUERY_POOL_HEALTH: Final = "health"


# Batches (workflows/job_batch.py): one `JobBatch` workflow per batch, whose ID is the batch's;
# each of its jobs carries the `batch` label and signals `job_ended` once it is terminal.
BATCH_WORKFLOW_TYPE: Final = "JobBatch"
BATCH_LABEL: Final = "batch"
SIGNAL_BATCH_JOB_ENDED: Final = "job_ended"
# The client that started the batch's jobs says it started every one.
SIGNAL_BATCH_SUBMITTED: Final = "submitted"
UPDATE_BATCH_CANCEL: Final = "cancel"
QUERY_BATCH_STATUS: Final = "status"
QUERY_BATCH_RESULTS: Final = "results"
# Every unfinished job of a cancelled batch told to stop; its jobs that ended unheard.
ACTIVITY_CANCEL_BATCH_JOBS: Final = "cancel_batch_jobs"
ACTIVITY_ENDED_BATCH_JOBS: Final = "ended_batch_jobs"
ACTIVITY_START_BATCH_JOBS: Final = "start_batch_jobs"

# Tenants' daily budgets (workflows/budget_ledger.py): one `TenantLedger` workflow per tenant
# with a budget, for every task queue and worker; a worker's check starts it with its limits
# (signal `limits`) and reads its spend (query `usage`); each budgeted job tells it its spend
# once it has ended (signal `spent`).
LEDGER_WORKFLOW_TYPE: Final = "TenantLedger"
SIGNAL_LEDGER_LIMITS: Final = "limits"
SIGNAL_LEDGER_SPENT: Final = "spent"
QUERY_LEDGER_USAGE: Final = "usage"
# A job's spend, by signal-with-start, when its ledger was not running (terminated).
ACTIVITY_RECORD_SPEND: Final = "record_spend"


def ledger_id(tenant: str) -> str:
    """The tenant's ledger's workflow id: one per tenant, whatever the task queue."""
    return f"durable-comfy-budget:{tenant}"


def pool_queue_id(task_queue: str, pool: str) -> str:
    """The dispatcher's workflow id: one per pool of each task queue's workers."""
    return f"durable-comfy-pool-queue:{task_queue}:{pool}"


# Activities: the workflow schedules them by these names, the worker registers them under them.
ACTIVITY_PREPARE: Final = "prepare_prompt"
ACTIVITY_FOLLOW: Final = "follow_prompt"  # submits (socket first) and follows
ACTIVITY_OFFLOAD: Final = "offload_outputs"
ACTIVITY_STOP: Final = "stop_prompt"  # one check of a stop
ACTIVITY_DELIVER_WEBHOOK: Final = "deliver_webhook"  # one attempt to POST one event
# Signal-with-start of a pool's dispatcher (a job whose signal found none running).
ACTIVITY_OPEN_POOL_QUEUE: Final = "open_pool_queue"
# Which of a dispatcher's holders have closed without releasing (a terminated job).
ACTIVITY_CLOSED_JOBS: Final = "closed_jobs"
# The health of a pool of many servers, watched for its dispatcher: returns when it changes.
ACTIVITY_WATCH_SERVERS: Final = "watch_pool_servers"
# A RunPod endpoint's `/health`, watched for its pool's dispatcher: returns when it changes.
ACTIVITY_WATCH_ENDPOINT: Final = "watch_endpoint_health"

# A worker that pushes live progress polls under `<identity> live=<its address>`, so a client
# that lists the task queue's pollers can subscribe there before a job names its worker.
LIVE_IN_IDENTITY: Final = " live="

# Search attributes registered on the server (temporal-dev.yaml lists them too).
SA_JOB_STATE: Final = "JobState"
SA_JOB_PROGRESS: Final = "JobProgress"
SA_JOB_POOL: Final = "JobPool"
SA_TENANT: Final = "Tenant"
STATE_KEY: Final = SearchAttributeKey.for_keyword(SA_JOB_STATE)
PROGRESS_KEY: Final = SearchAttributeKey.for_int(SA_JOB_PROGRESS)
POOL_KEY: Final = SearchAttributeKey.for_keyword(SA_JOB_POOL)

# The request label that names the job's tenant (the `Tenant` search attribute's value); a job
# without one belongs to the tenant of an unauthenticated local gateway.
TENANT_LABEL: Final = "tenant"
DEFAULT_TENANT: Final = "local"

JOB_ID_PATTERN: Final = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")

# In a `PromptLost` failure's first details mapping: true when the backend guarantees that
# submitting the prompt again cannot run it twice (RunPod with claims).
AT_MOST_ONCE: Final = "at_most_once"
# Losses of such a backend the workflow resubmits without asking, per job, before a person
# decides (a graph that kills every worker it reaches must not be paid for forever).
AT_MOST_ONCE_RESUBMITS: Final = 3


class ErrorType:
    """`ApplicationError.type` values. Clients branch on these, so they never change meaning."""

    INVALID_REQUEST: Final = "InvalidRequest"
    INVALID_GRAPH: Final = "InvalidGraph"
    UNKNOWN_POOL: Final = "UnknownPool"
    MISSING_INPUT: Final = "MissingInput"
    PROMPT_REJECTED: Final = "PromptRejected"
    BACKEND_UNAVAILABLE: Final = "BackendUnavailable"
    BACKEND_ERROR: Final = "BackendError"  # the backend refused a call (4xx): retrying won't help
    CONNECTION_LOST: Final = "ConnectionLost"
    EXECUTION_ERROR: Final = "ExecutionError"
    OUT_OF_MEMORY: Final = "OutOfMemory"
    BACKEND_FAULT: Final = "BackendFault"  # the GPU is broken: the pool needs replacing
    INTERRUPTED: Final = "Interrupted"
    PROMPT_LOST: Final = "PromptLost"
    # A submission was sent and its answer lost: the work may or may not exist. Resubmitting is
    # safe only where the backend deduplicates (RunPod with claims); otherwise a person decides.
    SUBMISSION_AMBIGUOUS: Final = "SubmissionAmbiguous"
    OUTPUT_MISSING: Final = "OutputMissing"
    STORAGE_ERROR: Final = "StorageError"
    TIMEOUT: Final = "Timeout"
    # The job asked for a priority its tenant's `max_priority` forbids.
    PRIORITY_NOT_ALLOWED: Final = "PriorityNotAllowed"
    QUEUE_TIMEOUT: Final = "QueueTimeout"  # waited in the backend's queue past queue_timeout_s
    # Not begun to run on a GPU by policy.start_by_s: withdrawn, ended EXPIRED.
    EXPIRED: Final = "Expired"
    TEARDOWN_FAILED: Final = "TeardownFailed"
    CANCELLED: Final = "Cancelled"
    RESUME_REFUSED: Final = "ResumeRefused"  # the resume update's refusal (the job goes on)
    ABANDONED: Final = "Abandoned"
    # A batch's job that its client never started (workflows/job_batch.py).
    NEVER_STARTED: Final = "NeverStarted"
    # A tenant's ledger (its daily budget) could not be read: the check is tried again.
    BUDGET_UNKNOWN: Final = "BudgetUnknown"


def reconnect_delay(attempt: int, base_s: float, max_s: float, u: float) -> float:
    """`min(base·2^attempt, max)·U(0.5, 1)`, with `u` drawn uniformly from [0, 1).

    The workflow draws `u` from `workflow.random()` (deterministic on replay); clients from
    `random.random()`. The jitter keeps many clients that lost the same server from coming back
    in lockstep; the lower bound of half the delay keeps the backoff meaningful.
    """
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    if not 0.0 <= u < 1.0:
        raise ValueError("u must be in [0, 1)")
    exponent = min(attempt, 62)  # 2**62 s is already far past any max_s
    return min(base_s * 2.0**exponent, max_s) * (0.5 + 0.5 * u)
