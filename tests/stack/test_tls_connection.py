"""The worker and the CLI reach Temporal through TLS with a client certificate.

The dev server speaks plain gRPC, so nginx stands in front of it (tests/stack/tls_support.py):
TLS with a server certificate from a test CA, a client certificate required
(`ssl_verify_client on`), `grpc_pass` to the dev server. The worker and the CLI are configured
only through a Temporal environment-configuration profile (TEMPORAL_CONFIG_FILE +
TEMPORAL_PROFILE: address, server CA, client certificate and key, server name), no
TEMPORAL_ADDRESS, so the production connection path (`starter.connection.connect_temporal`,
the worker's start-up checks) is what runs.

- A job submitted by the CLI through the front is run by a worker connected through the front,
  and completes with its artifact's sha256 verified; nginx's log shows both the CLI's and the
  worker's calls, each with the client certificate verified.
- A CLI whose profile has no client certificate is refused: one clear error, no traceback.

Needs Debian's nginx (`/usr/sbin/nginx`): `make test` installs it; without it these tests skip.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from activities.storage import ArtifactStore
from devstack.models import RunningStack
from faults.graphs import SAVE_NODE, sampler_graph
from faults.worker_proc import KillableWorker, clean_environ
from starter.connection import connect_temporal
from tests.stack.tls_support import NginxFront, TlsFiles, client_profile, nginx_binary, nginx_front
from tests.support.cli import json_lines, run_cli, s3_settings

NGINX = nginx_binary()
pytestmark = pytest.mark.skipif(
    NGINX is None,
    reason="nginx is not installed (`make test` installs it: apt-get install -y nginx-light)",
)

PROFILE = "tls-front"
NO_CERT_PROFILE = "tls-front-no-client-cert"


@dataclass
class TlsSetup:
    front: NginxFront
    tls: TlsFiles
    config_file: Path
    task_queue: str
    worker: KillableWorker
    stack: RunningStack

    def env(self, profile: str = PROFILE) -> dict[str, str]:
        """What a user's shell holds: the profile names the server and its TLS; S3 as usual.
        No TEMPORAL_ADDRESS or TEMPORAL_NAMESPACE: they would win over the profile's."""
        stack_env = {
            k: v
            for k, v in self.stack.worker_env().items()
            if k not in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE")
        }
        return {
            **clean_environ(),
            **stack_env,
            "TEMPORAL_CONFIG_FILE": str(self.config_file),
            "TEMPORAL_PROFILE": profile,
            "DURABLE_COMFY_TASK_QUEUE": self.task_queue,
        }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tls_setup(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[TlsSetup]:
    assert NGINX is not None
    base = tmp_path_factory.mktemp("tls")
    tls = TlsFiles.issue(base / "certs")
    async with nginx_front(NGINX, base / "nginx", local_stack.temporal_address, tls) as front:
        config_file = base / "temporal.toml"
        for profile, with_cert in ((PROFILE, True), (NO_CERT_PROFILE, False)):
            client_profile(
                config_file,
                profile,
                address=front.address,
                namespace=local_stack.namespace,
                tls=tls,
                with_client_cert=with_cert,
            )
        task_queue = f"tls-{uuid.uuid4().hex[:8]}"
        worker = KillableWorker({}, base / "worker.log", name="tls-worker")
        setup = TlsSetup(front, tls, config_file, task_queue, worker, local_stack)
        pools = {"comfyui": {"kind": "comfyui", "url": local_stack.comfyui_url}}
        worker.env = {
            **worker.env,
            **setup.env(),
            "DURABLE_COMFY_POOLS": json.dumps(pools),
            "DURABLE_COMFY_DEFAULT_POOL": "comfyui",
        }
        try:
            await setup.worker.start()
            yield setup
        finally:
            await setup.worker.terminate(grace_s=10.0)
            print(f"==== worker log ====\n{setup.worker.log_tail(40)}")
    assert not front.group_alive(), "nginx processes left running"
    assert setup.worker.running_pids() == []


async def test_cli_job_through_the_tls_front_runs_on_a_worker_behind_it(
    tls_setup: TlsSetup, tmp_path: Path
) -> None:
    graph = tmp_path / "graph.json"
    graph.write_text(json.dumps(sampler_graph(4)))
    job_id = f"tls-{uuid.uuid4().hex[:10]}"
    code, out, err = await run_cli(
        "submit", str(graph), "--job-id", job_id, "--watch", "--json", env=tls_setup.env()
    )
    assert code == 0, (out, err)
    final = json_lines(out)[-1]
    assert final["job_id"] == job_id and final["state"] == "COMPLETED", final

    # The artifact is in S3 with the bytes the job recorded.
    [artifact] = final["artifacts"]
    assert artifact["node_id"] == SAVE_NODE
    async with ArtifactStore(s3_settings(tls_setup.stack)) as store:
        await store.download(
            artifact["key"], tmp_path / "out.png", expected_sha256=artifact["sha256"]
        )

    # The worker behind the front ran it: its identity is in the job's history.
    temporal = await connect_temporal(tls_setup.stack.temporal_address, tls_setup.stack.namespace)
    history = await temporal.get_workflow_handle(job_id).fetch_history()
    identities = {
        e.activity_task_started_event_attributes.identity
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    }
    assert identities == {
        f"{tls_setup.worker.pid}@{ident.split('@', 1)[1]}" for ident in identities
    }
    assert identities, "no activity recorded"

    # Both went through nginx, with the client certificate verified: the CLI started the job,
    # the worker answered its tasks (nginx logs a call when it ends: long polls still open are
    # not there yet).
    calls = tls_setup.front.grpc_calls()
    by_method = {call["uri"].rsplit("/", 1)[-1]: call for call in calls}
    worker_calls = ("RespondWorkflowTaskCompleted", "RespondActivityTaskCompleted")
    for method in ("StartWorkflowExecution", *worker_calls):
        assert method in by_method, f"{method} did not go through the front: {sorted(by_method)}"
    assert {call["verify"] for call in calls} == {"SUCCESS"}, calls[:5]
    assert {call["client"] for call in calls} == {tls_setup.tls.client_subject()}, calls[:5]


async def refused_cli(setup: TlsSetup) -> tuple[int, list[str], list[dict[str, str]]]:
    """`durable-comfy status` with a profile that has the CA but no client certificate: its
    exit code, its stderr lines, and what nginx logged meanwhile."""
    calls_before = len(setup.front.grpc_calls())
    code, out, err = await run_cli("status", "no-such-job", env=setup.env(NO_CERT_PROFILE))
    print(f"exit {code}\nstdout: {out!r}\nstderr: {err!r}")
    assert "Traceback" not in err and "Traceback" not in out
    assert out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    # nginx writes a call's line when the connection ends, which may be after the CLI has
    # exited (a CI run read the log too soon and found nothing): give it a few seconds.
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        refused = setup.front.grpc_calls()[calls_before:]
        if refused or asyncio.get_running_loop().time() > deadline:
            return code, lines, refused
        await asyncio.sleep(0.1)


async def test_a_client_without_a_certificate_is_refused_with_one_clear_error(
    tls_setup: TlsSetup,
) -> None:
    code, lines, refused = await refused_cli(tls_setup)
    assert code == 3, "the CLI's code for Temporal unreachable (docs/cli.md)"
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[0] == errors[0], f"one error, first: {lines}"
    assert "cannot reach Temporal" in errors[0], errors[0]
    # nginx saw the client and refused it (no certificate): nothing was passed on.
    assert refused, "the CLI never reached the front"
    assert all(call["verify"] == "NONE" and call["status"] == "400" for call in refused), refused
    assert all(call["grpc_status"] == "" for call in refused), "a call reached the server"


async def test_the_refusal_names_the_address_and_the_missing_certificate(
    tls_setup: TlsSetup,
) -> None:
    _, lines, _ = await refused_cli(tls_setup)
    text = "\n".join(lines)
    assert tls_setup.front.address in lines[0], lines
    assert "certificate" in text.lower(), lines
    assert "Status {" not in text and "MetadataMap" not in text, lines
    assert "dev up" not in text, "the server answered: the stack is up"
