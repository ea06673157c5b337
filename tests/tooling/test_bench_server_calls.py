"""bench/server_calls.py: the Temporal server's counts of the calls it served, as the bench reads
them from its Prometheus metrics (frontend RPCs by operation, database operations in all)."""

from __future__ import annotations

# ruff: noqa: E501  (Prometheus lines as the server writes them, one sample a line)
from bench.server_calls import PERSISTENCE, calls_table, parse

METRICS = """\
# HELP service_requests service_requests counter
# TYPE service_requests counter
service_requests{namespace="default",operation="RecordActivityTaskHeartbeat",service_name="frontend"} 40
service_requests{namespace="default",operation="RecordActivityTaskHeartbeat",service_name="history"} 40
service_requests{namespace="default",operation="StartWorkflowExecution",service_name="frontend"} 2
service_requests{namespace="_unknown_",operation="GetSystemInfo",service_name="frontend"} 7
persistence_requests{namespace="default",operation="UpdateWorkflowExecution",service_name="history"} 30
persistence_requests{namespace="default",operation="GetNamespace",service_name="frontend"} 1
service_latency_bucket{namespace="default",operation="StartWorkflowExecution",le="0.01"} 2
"""


def test_frontend_calls_of_the_namespace_and_its_database_operations_are_counted() -> None:
    calls = parse(METRICS)
    # The history service's share of the same heartbeats is not a second call; other namespaces
    # and histograms are not calls of the jobs measured.
    assert calls.counts["RecordActivityTaskHeartbeat"] == 40
    assert calls.counts["StartWorkflowExecution"] == 2
    assert "GetSystemInfo" not in calls.counts
    assert calls.counts[PERSISTENCE] == 31
    assert calls.rpcs == 42


def test_a_phase_is_the_difference_of_two_readings_per_job() -> None:
    before = parse(METRICS)
    after = parse(METRICS.replace("} 40\n", "} 100\n", 1).replace("} 2\n", "} 4\n", 1))
    phase = after.minus(before)
    assert phase.top() == [("RecordActivityTaskHeartbeat", 60), ("StartWorkflowExecution", 2)]
    table = calls_table(phase, 2, "job")
    assert "| RecordActivityTaskHeartbeat | 30 |" in table
    assert "| all RPCs | 31 |" in table
