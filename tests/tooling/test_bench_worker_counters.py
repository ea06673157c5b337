"""bench/worker_counters.py: the project's counters from a worker's /metrics, keyed by name and
their own labels (the SDK's labels on every sample left out), as the scale table reads them."""

from __future__ import annotations

# ruff: noqa: E501  (Prometheus lines as the worker writes them, one sample a line)
from bench.worker_counters import parse

METRICS = """\
# HELP durable_comfy_live_follows Follow attempts begun, by whether a gateway awaited them
# TYPE durable_comfy_live_follows counter
durable_comfy_live_follows{namespace="default",service_name="temporal-core",subscribed="yes",task_queue="q"} 10
durable_comfy_live_follows{namespace="default",service_name="temporal-core",subscribed="no",task_queue="q"} 290
durable_comfy_live_subscribed_late{namespace="default",service_name="temporal-core",task_queue="q"} 2
durable_comfy_jobs_ended{namespace="default",service_name="temporal-core",state="COMPLETED",task_queue="q"} 300
temporal_live_follows{subscribed="yes"} 99
"""


def test_the_named_counters_are_keyed_by_their_own_labels() -> None:
    counts = parse(METRICS, ("live_follows", "live_subscribed_late"))
    assert counts == {
        "live_follows{subscribed=yes}": 10,
        "live_follows{subscribed=no}": 290,
        "live_subscribed_late": 2,
    }
