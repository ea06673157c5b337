"""The worker's Prometheus endpoint and the project's own metrics.

Temporal's SDK metrics (task latencies, polls, activity failures, ...) and ours share one
endpoint: `worker --metrics-port N` (or `DURABLE_COMFY_METRICS_PORT`) serves them all on
http://127.0.0.1:N/metrics. Ours are prefixed `durable_comfy_`:

| metric | kind | labels | from |
| --- | --- | --- | --- |
| `durable_comfy_jobs_ended` | counter | `state` | the workflow, once per job |
| `durable_comfy_reconnects` | counter | | the workflow, per durable reconnect timer |
| `durable_comfy_resubmissions` | counter | | the workflow, per prompt submitted again |
| `durable_comfy_teardown_seconds` | histogram | `state` | the workflow, stop start to end |
| `durable_comfy_orphans_swept` | counter | `pool`, `action` | the orphan sweep |
| `durable_comfy_bytes_offloaded` | counter | | every artifact stored in S3 |
| `durable_comfy_live_follows` | counter | `subscribed` | each follow, when live progress is on |
| `durable_comfy_live_subscribed_late` | counter | | a subscription after its follow began |
| `durable_comfy_queue_starts` | counter | `pool`, `tenant` | a bounded pool's queue, per grant |
| `durable_comfy_queue_wait_seconds` | histogram | `pool`, `tenant` | each grant's time PENDING |
| `durable_comfy_queue_waiting` | gauge | `pool`, `tenant` | the line, as last seen (`max by`) |
| `durable_comfy_queue_running` | gauge | `pool` | the queue's holders, the same way |

docs/grafana/queue.json is a Grafana dashboard of the queue's (tests/stack/test_pool_queue.py
checks that it asks only for metrics the workers export).

`live_follows{subscribed="yes"}` counts the follows a gateway had subscribed to before they
began (their first step pushed); `"no"` the others (activities/live_progress.py).

Workflow metrics are not emitted while a workflow replays, so a restarted worker does not count
a job twice.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.common import MetricMeter
from temporalio.runtime import LoggingConfig, PrometheusConfig, Runtime, TelemetryConfig

PREFIX = "durable_comfy_"


def prometheus_runtime(
    port: int, logging: LoggingConfig | None = None, host: str = "127.0.0.1"
) -> Runtime:
    """A Temporal runtime that serves every metric (SDK and ours) on host:port/metrics.

    `logging`: how the SDK core logs (the worker forwards it to Python logging, so stderr).
    """
    return Runtime(
        telemetry=TelemetryConfig(
            logging=logging,
            metrics=PrometheusConfig(bind_address=f"{host}:{port}", durations_as_seconds=True),
        )
    )


def count_offloaded(size: int) -> None:
    """Bytes stored in S3, counted from inside an activity (a no-op outside one)."""
    if activity.in_activity():
        meter = activity.metric_meter()
        meter.create_counter(PREFIX + "bytes_offloaded", "Bytes of artifacts stored", "By").add(
            size
        )


def count_swept(meter: MetricMeter, pool: str, action: str) -> None:
    meter.create_counter(PREFIX + "orphans_swept", "Prompts of ended jobs stopped").add(
        1, {"pool": pool, "action": action}
    )
