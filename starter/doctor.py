"""`durable-comfy doctor`: is everything a worker needs there? The worker runs the same checks
at start (all but "a worker polls", which it is itself).

Checks, in order; each gives one `CheckResult` (ok, FAIL with what to do, or skipped when a
check it needs failed):

    temporal           the server answers at the configured address (TEMPORAL_ADDRESS, else the
                       profile's; TLS and API key as Temporal's environment configuration says)
    namespace          the namespace exists
    search_attributes  every search attribute a job uses is registered, with its type
    worker             a worker polled the workflow task queue (DURABLE_COMFY_TASK_QUEUE) lately
    bucket             a small object can be put and deleted under the jobs' prefix
    runpod             each runpod pool's endpoint answers `GET /health` with the pool's key
                       (the worker's check, worker.py: the pools are worker settings)
    encryption         DURABLE_COMFY_CODEC_KEYS(_FILE), when set, hold usable keys
    gateway            only with `--gateway URL`: the HTTP gateway there answers `/readyz`
                       (it serves, and reaches Temporal)

A failure is a `CONFIGURATION` problem (fix a setting, register something: exit 2) or an
`UNREACHABLE` one (something is down or not started: exit 3); configuration wins when both.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import IntEnum, StrEnum
from typing import Any

import httpx
import structlog
from pydantic import BaseModel, ConfigDict, ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.converter import PayloadCodec
from temporalio.envconfig import ClientConfig
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode

from activities.storage import ArtifactStore
from configuration.codec_keys import KEYS_ENV, KEYS_FILE_ENV
from configuration.errors import CodecSettingsError
from configuration.settings import (
    ClientSettings,
    CodecSettings,
    S3Settings,
    TemporalSettings,
    TemporalTarget,
)
from starter.client import SEARCH_ATTRIBUTES
from starter.codec import EncryptionCodec
from starter.connection import (
    DEFAULT_ADDRESS,
    connect_failure_gist,
    connect_temporal,
)
from starter.errors import ChecksFailed, register_commands
from starter.pollers import live_pollers, workflow_pollers
from workflows.contracts import OutputSpec
from workflows.errors import StorageConfigError, StorageError

log = structlog.get_logger("doctor")

CONNECT_TIMEOUT = timedelta(seconds=5)
RPC_TIMEOUT = timedelta(seconds=5)
# An S3 or RunPod call: the bucket's client retries once, each try up to its connect timeout.
CALL_TIMEOUT_S = 15.0
# Where the bucket check writes (and at once deletes) its object: under the jobs' default
# prefix, so a policy that allows only that prefix is what gets tested.
PROBE_FOLDER = f"{OutputSpec.model_fields['prefix'].default}/_doctor"
_TYPE_NAMES = {
    IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD: "Keyword",
    IndexedValueType.INDEXED_VALUE_TYPE_INT: "Int",
}


class Check(StrEnum):
    TEMPORAL = "temporal"
    NAMESPACE = "namespace"
    SEARCH_ATTRIBUTES = "search_attributes"
    WORKER = "worker"
    BUCKET = "bucket"
    RUNPOD = "runpod"
    POOLS = "pools"
    ENCRYPTION = "encryption"
    GATEWAY = "gateway"


class Outcome(StrEnum):
    OK = "ok"
    FAIL = "fail"
    SKIPPED = "skipped"


class Problem(StrEnum):
    CONFIGURATION = "configuration"
    UNREACHABLE = "unreachable"


class DoctorExit(IntEnum):
    """The doctor's (and the worker's refused start's) exit codes; the CLI's table's 2 and 3."""

    OK = 0
    CONFIGURATION = 2
    UNREACHABLE = 3


class CheckResult(BaseModel):
    """One check's verdict; `message` is one line: what was found, or what to do."""

    model_config = ConfigDict(frozen=True)

    check: Check
    outcome: Outcome
    message: str
    problem: Problem | None = None

    @property
    def failed(self) -> bool:
        return self.outcome is Outcome.FAIL

    def line(self) -> str:
        label = {Outcome.OK: "ok", Outcome.FAIL: "FAIL", Outcome.SKIPPED: "skip"}[self.outcome]
        return f"{label:<4}  {self.check.value}: {self.message}"


def ok(check: Check, message: str) -> CheckResult:
    return CheckResult(check=check, outcome=Outcome.OK, message=message)


def fail(check: Check, message: str, problem: Problem = Problem.CONFIGURATION) -> CheckResult:
    return CheckResult(check=check, outcome=Outcome.FAIL, message=message, problem=problem)


def skipped(check: Check, needs: Check) -> CheckResult:
    return CheckResult(check=check, outcome=Outcome.SKIPPED, message=f"skipped (needs {needs})")


def exit_code(results: list[CheckResult]) -> DoctorExit:
    problems_found = {r.problem for r in results if r.failed}
    if Problem.CONFIGURATION in problems_found:
        return DoctorExit.CONFIGURATION
    if Problem.UNREACHABLE in problems_found:
        return DoctorExit.UNREACHABLE
    return DoctorExit.OK


# --- what the checks are given ----------------------------------------------------------------


# The worker's own check of its RunPod pools (worker.py): the client library holds no worker
# code, so the CLI gets it from the `worker` plugin (starter.cli.doctor).
RunPodCheck = Callable[[], Awaitable[CheckResult]]
# And its check of its ComfyUI pools' servers (the same plugin).
PoolsCheck = Callable[[], Awaitable[CheckResult]]


@dataclass
class Inputs:
    """The settings the checks use, each with the problem that stopped it loading (if any)."""

    temporal: TemporalSettings | None = None
    task_queue: str | None = None
    s3: S3Settings | None = None
    codec: EncryptionCodec | None = None
    runpod: RunPodCheck | None = None
    pools: PoolsCheck | None = None
    # An HTTP gateway to check as well (`doctor --gateway URL`); None: no gateway check.
    gateway_url: str | None = None
    errors: dict[Check, str] = field(default_factory=dict)

    @classmethod
    def from_environment(
        cls,
        runpod: RunPodCheck | None = None,
        gateway_url: str | None = None,
        pools: PoolsCheck | None = None,
    ) -> Inputs:
        """Read as the job commands and the worker read them, without stopping at the first
        bad one: each problem fails the check that needs the setting."""
        inputs = cls(runpod=runpod, gateway_url=gateway_url, pools=pools)
        codec_problem = inputs._read_codec()
        try:
            inputs.temporal = TemporalSettings()
        except ValidationError as exc:
            if codec_problem is None:
                inputs.errors[Check.TEMPORAL] = f"invalid settings: {problems(exc)}"
            else:
                # Only the codec's keys are wrong: the encryption check says so, and the
                # connection is tried without them (no check sends a payload).
                target = TemporalTarget()
                inputs.temporal = TemporalSettings.model_construct(
                    address=target.address, namespace=target.namespace
                )
        try:
            inputs.task_queue = ClientSettings().task_queue
        except ValidationError as exc:
            inputs.errors[Check.WORKER] = f"invalid settings: {problems(exc)}"
        try:
            inputs.s3 = S3Settings.from_env()
        except StorageConfigError as exc:
            inputs.errors[Check.BUCKET] = str(exc)
        return inputs

    @classmethod
    def of(
        cls,
        temporal: TemporalSettings | None,
        task_queue: str,
        s3: S3Settings,
        runpod: RunPodCheck | None,
        pools: PoolsCheck | None = None,
    ) -> Inputs:
        """Settings the worker has already read (and the codec's, read here)."""
        inputs = cls(temporal=temporal, task_queue=task_queue, s3=s3, runpod=runpod, pools=pools)
        inputs._read_codec()
        return inputs

    def _read_codec(self) -> str | None:
        try:
            ring = CodecSettings.from_environ().key_ring()
        except (CodecSettingsError, ValidationError) as exc:
            message = problems(exc) if isinstance(exc, ValidationError) else str(exc)
            self.errors[Check.ENCRYPTION] = message
            return message
        self.codec = None if ring is None else EncryptionCodec(ring)
        return None


# --- the checks ---------------------------------------------------------------------------------


class Doctor:
    """Runs the checks in order; `client` is the Temporal client the first one connected."""

    def __init__(self, inputs: Inputs, *, runtime: Runtime | None = None) -> None:
        self.inputs = inputs
        self.runtime = runtime
        self.client: Client | None = None

    async def run(self, *, skip: frozenset[Check] = frozenset()) -> AsyncIterator[CheckResult]:
        passed: set[Check] = set()

        async def needing(check: Check, needs: tuple[Check, ...], run: Any) -> CheckResult:
            for need in needs:
                if need not in passed:
                    return skipped(check, need)
            if (problem := self.inputs.errors.get(check)) is not None:
                return fail(check, problem)
            result: CheckResult = await run()
            return result

        steps = (
            (Check.TEMPORAL, (), self._temporal),
            (Check.NAMESPACE, (Check.TEMPORAL,), self._namespace),
            (Check.SEARCH_ATTRIBUTES, (Check.NAMESPACE,), self._search_attributes),
            (Check.WORKER, (Check.NAMESPACE,), self._worker),
            (Check.BUCKET, (), self._bucket),
            (Check.RUNPOD, (), self._runpod),
            (Check.POOLS, (), self._pools),
            (Check.ENCRYPTION, (), self._encryption),
            (Check.GATEWAY, (), self._gateway),
        )
        for check, needs, run in steps:
            if check in skip or (check is Check.GATEWAY and self.inputs.gateway_url is None):
                continue
            result = await needing(check, needs, run)
            log.debug("doctor_check", check=check.value, outcome=result.outcome.value)
            if result.outcome is Outcome.OK:
                passed.add(check)
            yield result

    def _address(self) -> str:
        temporal = self.inputs.temporal
        if temporal is not None and temporal.address:
            return temporal.address
        return str(_environ_config().get("target_host") or DEFAULT_ADDRESS)

    async def _temporal(self) -> CheckResult:
        temporal = self.inputs.temporal
        address = self._address()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT.total_seconds() * 2):
                self.client = await connect_temporal(
                    temporal.address if temporal else None,
                    temporal.namespace if temporal else None,
                    runtime=self.runtime,
                    codec=self._codec(),
                )
        except (RuntimeError, TimeoutError, ValueError) as exc:
            return fail(
                Check.TEMPORAL,
                f"cannot reach Temporal at {address} ({connect_failure_gist(exc)}): "
                "check TEMPORAL_ADDRESS (or the profile's address: TEMPORAL_CONFIG_FILE, "
                "TEMPORAL_PROFILE), TLS (TEMPORAL_TLS*) and TEMPORAL_API_KEY, and that the "
                "server is up (`durable-comfy dev up` for the local stack)",
                Problem.UNREACHABLE,
            )
        return ok(Check.TEMPORAL, f"reachable at {address}")

    async def _namespace(self) -> CheckResult:
        client = self._client()
        try:
            await client.workflow_service.describe_namespace(
                DescribeNamespaceRequest(namespace=client.namespace), timeout=RPC_TIMEOUT
            )
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return fail(
                    Check.NAMESPACE,
                    f"namespace {client.namespace!r} does not exist on {self._address()}: set "
                    "TEMPORAL_NAMESPACE to yours, or create it (`temporal operator namespace "
                    f"create --namespace {client.namespace}`)",
                )
            return _rpc_failure(Check.NAMESPACE, exc, f"describing {client.namespace!r}")
        return ok(Check.NAMESPACE, f"{client.namespace!r} exists")

    async def _search_attributes(self) -> CheckResult:
        client = self._client()
        try:
            listed = await client.operator_service.list_search_attributes(
                ListSearchAttributesRequest(namespace=client.namespace), timeout=RPC_TIMEOUT
            )
        except RPCError as exc:
            return _rpc_failure(Check.SEARCH_ATTRIBUTES, exc, "listing search attributes")
        registered = {
            name: _TYPE_NAMES.get(kind, IndexedValueType.Name(kind))
            for name, kind in listed.custom_attributes.items()
        }
        wrong_type = [
            f"{name} is {registered[name]}, not {kind}"
            for name, kind in SEARCH_ATTRIBUTES.items()
            if name in registered and registered[name] != kind
        ]
        missing = {n: k for n, k in SEARCH_ATTRIBUTES.items() if n not in registered}
        if wrong_type:
            return fail(
                Check.SEARCH_ATTRIBUTES,
                f"namespace {client.namespace!r}: {'; '.join(wrong_type)}: a search attribute's "
                "type cannot change; use a namespace without them (or remove them first)",
            )
        if missing:
            self_hosted, cloud = register_commands(client.namespace, missing)
            return fail(
                Check.SEARCH_ATTRIBUTES,
                f"namespace {client.namespace!r} lacks {', '.join(missing)}: run {self_hosted} "
                f"(self-hosted), or {cloud} (Temporal Cloud, or its UI: the namespace's "
                "Search Attributes)",
            )
        return ok(Check.SEARCH_ATTRIBUTES, f"{', '.join(SEARCH_ATTRIBUTES)} registered")

    async def _worker(self) -> CheckResult:
        client = self._client()
        task_queue = self.inputs.task_queue
        assert task_queue is not None  # else its settings error was reported
        try:
            async with asyncio.timeout(RPC_TIMEOUT.total_seconds()):
                pollers = live_pollers(await workflow_pollers(client, task_queue))
        except RPCError as exc:
            return _rpc_failure(Check.WORKER, exc, f"describing task queue {task_queue!r}")
        except TimeoutError:
            return fail(
                Check.WORKER,
                f"Temporal did not answer describing task queue {task_queue!r} in time",
                Problem.UNREACHABLE,
            )
        if not pollers:
            return fail(
                Check.WORKER,
                f"no worker polls task queue {task_queue!r} in namespace {client.namespace!r}: "
                "start one (`durable-comfy worker`), or set DURABLE_COMFY_TASK_QUEUE to the "
                "queue your workers poll",
                Problem.UNREACHABLE,
            )
        names = ", ".join(sorted({p.identity for p in pollers}))
        return ok(Check.WORKER, f"{len(pollers)} poller(s) on {task_queue!r}: {names}")

    async def _bucket(self) -> CheckResult:
        s3 = self.inputs.s3
        assert s3 is not None  # else its settings error was reported
        key = f"{PROBE_FOLDER}/{uuid.uuid4().hex}"
        where = f"s3://{s3.bucket}/{PROBE_FOLDER}/"
        endpoint = s3.endpoint_url or "AWS's default endpoint"
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S), ArtifactStore(s3) as store:
                # HeadBucket first: some servers (SeaweedFS) create a bucket on the first put.
                if not await store.bucket_exists():
                    return fail(
                        Check.BUCKET,
                        f"bucket {s3.bucket!r} does not exist at {endpoint}: create it, or set "
                        "DURABLE_COMFY_BUCKET to the bucket the jobs write to",
                    )
                await store.put_small(key, b"durable-comfy doctor\n", content_type="text/plain")
                await store.delete(key)
        except StorageConfigError as exc:
            return fail(
                Check.BUCKET,
                f"cannot write under {where} ({one_line(exc)}): create the bucket, or fix "
                "DURABLE_COMFY_BUCKET / the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...) "
                "so they may put and delete there",
            )
        except (StorageError, TimeoutError) as exc:
            return fail(
                Check.BUCKET,
                f"cannot reach S3 at {endpoint} ({one_line(exc) or 'no answer in time'}): "
                "check DURABLE_COMFY_S3_ENDPOINT and that the server is up",
                Problem.UNREACHABLE,
            )
        return ok(Check.BUCKET, f"put and delete under {where} work ({endpoint})")

    async def _runpod(self) -> CheckResult:
        if self.inputs.runpod is None:
            return CheckResult(
                check=Check.RUNPOD,
                outcome=Outcome.SKIPPED,
                message="skipped (needs the worker, which reads the pools: not installed here)",
            )
        return await self.inputs.runpod()

    async def _pools(self) -> CheckResult:
        if self.inputs.pools is None:
            return CheckResult(
                check=Check.POOLS,
                outcome=Outcome.SKIPPED,
                message="skipped (needs the worker, which reads the pools: not installed here)",
            )
        return await self.inputs.pools()

    async def _encryption(self) -> CheckResult:
        codec = self.inputs.codec
        if codec is None:
            return ok(Check.ENCRYPTION, f"off (neither {KEYS_ENV} nor {KEYS_FILE_ENV} is set)")
        # Round trip: a key that parses but cannot seal and open is no key.
        probe = Payload(metadata={"encoding": b"binary/plain"}, data=b"doctor")
        if codec.decrypt(codec.encrypt(probe)) != probe:
            return fail(Check.ENCRYPTION, "the active key does not decrypt what it encrypts")
        return ok(
            Check.ENCRYPTION,
            f"on: {len(codec.ring.ids)} key(s), active {codec.active_id!r}",
        )

    async def _gateway(self) -> CheckResult:
        url = str(self.inputs.gateway_url).rstrip("/")
        try:
            async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S, trust_env=False) as http:
                answer = await http.get(f"{url}/readyz")
        except httpx.HTTPError as exc:
            return fail(
                Check.GATEWAY,
                f"nothing answers at {url} ({type(exc).__name__}): start `durable-comfy gateway` "
                "there, or give the URL its clients use",
                Problem.UNREACHABLE,
            )
        if answer.status_code == 200:
            return ok(Check.GATEWAY, f"{url} is ready (it serves and reaches Temporal)")
        if answer.status_code == 503:
            return fail(
                Check.GATEWAY,
                f"{url} serves but is not ready: Temporal does not answer it (give the gateway "
                "the same TEMPORAL_* settings as the workers)",
                Problem.UNREACHABLE,
            )
        return fail(
            Check.GATEWAY,
            f"{url}/readyz answered {answer.status_code}: not a durable-comfy gateway, or not "
            "its base path (the URL its clients use, before /v1)",
        )

    def _codec(self) -> PayloadCodec | None:
        """The codec to connect with. Unusable keys are the encryption check's to report: the
        connection's checks go on without them (none of them sends a payload)."""
        if self.inputs.codec is None and Check.ENCRYPTION in self.inputs.errors:
            return _NoPayloads()
        return self.inputs.codec

    def _client(self) -> Client:
        if self.client is None:
            raise RuntimeError("the temporal check connects first")
        return self.client


# Services a worker rides out when they are down: each activity retries against them, and a
# worker that refused to start during an S3 or RunPod outage would also stop every job of its
# other pools (and crash-loop under a process manager). Temporal is not one of them.
RIDDEN_OUT = frozenset({Check.BUCKET, Check.RUNPOD, Check.POOLS})


def refuses_start(result: CheckResult) -> bool:
    """A failure the worker must not start with: any wrong setting or missing registration, and
    Temporal not answering; not S3 or RunPod being down for now (a warning)."""
    return result.failed and not (
        result.problem is Problem.UNREACHABLE and result.check in RIDDEN_OUT
    )


async def connect_checked(inputs: Inputs, runtime: Runtime | None = None) -> Client:
    """The worker's start: every check but "a worker polls" (it is the worker), then the client
    the first check connected. Raises `ChecksFailed` when a check fails with a problem the worker
    must not start with (`refuses_start`); S3 or RunPod not answering is logged and ridden out."""
    doctor = Doctor(inputs, runtime=runtime)
    results = [result async for result in doctor.run(skip=frozenset({Check.WORKER}))]
    if any(refuses_start(result) for result in results) or doctor.client is None:
        refusal = [result.line() for result in results if result.outcome is not Outcome.OK]
        raise ChecksFailed(refusal, exit_code(results))
    for result in results:
        if result.failed:
            log.warning("start_check_unreachable", check=result.check.value, detail=result.message)
    log.info("start_checks_passed", checks=[result.check.value for result in results])
    return doctor.client


# --- helpers ------------------------------------------------------------------------------------


def _rpc_failure(check: Check, exc: RPCError, doing: str) -> CheckResult:
    if exc.status in (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED):
        return fail(check, f"Temporal did not answer {doing}: {exc.message}", Problem.UNREACHABLE)
    if exc.status in (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNAUTHENTICATED):
        return fail(
            check,
            f"Temporal refused {doing} ({exc.status.name}: {one_line(exc.message)}): check "
            "TEMPORAL_API_KEY (or the profile's api_key) and its permissions on the namespace",
        )
    return fail(check, f"Temporal refused {doing}: {exc.status.name}: {one_line(exc.message)}")


class _NoPayloads(PayloadCodec):
    """Stands in for a codec whose keys are unusable: no check sends or reads a payload."""

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        raise RuntimeError("the doctor's checks send no payloads")

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        raise RuntimeError("the doctor's checks read no payloads")


def _environ_config() -> dict[str, Any]:
    try:
        return dict(ClientConfig.load_client_connect_config())
    except Exception:  # a broken profile: the connection check says so with its own words
        return {}


def problems(exc: ValidationError) -> str:
    """One line for a settings error: each problem with the variable it is about."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors()
    )


def one_line(exc: BaseException | str, limit: int = 300) -> str:
    text = re.sub(r"\s+", " ", str(exc)).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"
