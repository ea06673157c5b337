"""What `JobClient.connect()` reads from the environment: the same variables as the CLI.

    ClientSettings  DURABLE_COMFY_TASK_QUEUE, DURABLE_COMFY_QUERY_TIMEOUT_S,
                    DURABLE_COMFY_LIVE_PROGRESS_KEY; below them the production file's
                    worker.task_queue and client.query_timeout_s
    S3Settings      DURABLE_COMFY_BUCKET, DURABLE_COMFY_S3_ENDPOINT, AWS_* (activities.settings),
                    below them the file's storage section; only with a bucket set

Temporal's own variables (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, a profile) are
read by `starter.connection.connect_temporal`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import Field, SecretStr

from starter.variables import VariablesOnly
from workflows.shared import DEFAULT_TASK_QUEUE


class ClientSettings(VariablesOnly):
    """The client's own variables. Empty counts as unset; read only under these names."""

    task_queue: str = Field(DEFAULT_TASK_QUEUE, validation_alias="DURABLE_COMFY_TASK_QUEUE")
    # How long a status query waits for a worker to answer.
    query_timeout_s: float = Field(10.0, gt=0, validation_alias="DURABLE_COMFY_QUERY_TIMEOUT_S")
    # The workers' live-progress key: with it, `watch` also takes the steps the worker following
    # a job pushes (docs/configuration.md, "Live progress"); without it, it polls.
    live_progress_key: SecretStr | None = Field(
        None, validation_alias="DURABLE_COMFY_LIVE_PROGRESS_KEY"
    )

    # The queue the workers serve is the one the client starts jobs on. (A subclass's own
    # fields, such as the CLI's log level, are not read from the file.)
    file_keys: ClassVar[Mapping[str, str]] = {
        "task_queue": "worker.task_queue",
        "query_timeout_s": "client.query_timeout_s",
    }
