"""The pools a worker may run jobs on: `PoolConfig`, and the RunPod limits a pool is checked
against.

A pool comes from DURABLE_COMFY_POOLS, the production file's `pools:` or the dev stack file's
`worker:` section (configuration.settings.WorkerSettings); never its API key, which the variable
its `api_key_env` names holds (`configuration.settings.runpod_api_keys`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# An endpoint's id goes into every request's path: no `/`, no `..`.
ENDPOINT_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# `/run` policy ranges (PROTOCOLS.md): below or above them the platform refuses the job.
MIN_EXECUTION_TIMEOUT_S = 5.0
MAX_POLICY_S = 7 * 24 * 3600.0

RUNPOD_API_URL = "https://api.runpod.ai/v2"
RUNPOD_API_KEY_ENV = "RUNPOD_API_KEY"
_VARIABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# What a hidden value becomes (see `PoolConfig._hide_secrets`).
_HIDDEN = "<hidden>"
_RUNPOD_ONLY = (
    "endpoint_id",
    "api_key_env",
    "claims",
    "usd_per_second",
    "execution_timeout_s",
    "idle_timeout_s",
    "claim_lease_s",
    "fence_after_s",
    "status_poll_s",
    "report_interval_s",
    "node_registry",
    "cold_start_s",
)
# A runpod pool's cold start (a worker's image pulled and its ComfyUI started) when its settings
# name none: what a waiting job's estimate adds while the endpoint has no worker ready.
COLD_START_S = 40.0
# The most servers one pool names: each is a line of its queue's state and of `pool status`.
MAX_SERVERS = 64


class PoolConfig(BaseModel):
    """A named backend the worker may run jobs on. Requests name pools, never URLs.

    `comfyui`: `url` is the ComfyUI server; or `urls`, several servers that run the same nodes
    and models, one pool to the jobs (docs/pools.md). `server_slots`: how many of the pool's
    jobs each server holds at once (default 1: ComfyUI runs one prompt at a time, and a second
    would only wait in its queue, where our queue could still have sent it elsewhere). Our
    queue hands each job to a healthy, undrained server with a free slot (least loaded first,
    then the one that last ran the same graph, whose models are warm); `max_running` defaults
    to the sum of the servers' slots. A single-`url` pool keeps today's behaviour (unbounded,
    the server's own queue) unless `max_running` or `server_slots` is set.
    `runpod`: a serverless endpoint. `endpoint_id` (required) on the API at `url` (default
    RunPod's); its key is read once at start-up from the variable `api_key_env` names (default
    RUNPOD_API_KEY, see `runpod_api_keys`), never from a config file. `claims`: the endpoint runs
    our handler, which claims each submission, so resubmitting after a lost `/run` answer is safe;
    false for stock worker-comfyui endpoints (a person decides instead). `usd_per_second`: the
    endpoint's price, for the job's cost estimate. `execution_timeout_s`: sent as RunPod's
    `executionTimeout` instead of the job's own. `idle_timeout_s`: the endpoint's idle timeout,
    what a worker keeps billing after its last job (RunPod's default 5 s when unset).
    `claim_lease_s`: how long our handler's claim holds without renewal (default 60): how long a
    crashed worker's submission waits before another delivery may take it over.
    `fence_after_s`: how long past a lapsed lease its holder is certainly fenced (default 30:
    its handler stops the prompt before the lease ends, and its worker's watchdog stops it and
    takes the worker down by then when the handler is frozen); nobody runs the submission again
    before (docs/architecture.md, *Fencing*). Sent to the handler with every submission.
    `status_poll_s`: how often the follow of one job reads its `/status` while RunPod runs it
    (default 0.8, start to start; twice that while it is queued), and `report_interval_s`: how
    often our handler sends the platform a progress update while the steps move (default 0.25,
    sent with every submission): together, a running job's step reaches clients at least once
    a second. Each follow reads `/status` itself, so a pool's calls are about
    `running / status_poll_s` a second, against RunPod's 200 a second per endpoint.
    `node_registry`: what a runpod pool checks each graph against before any RunPod job exists
    (a class that is not installed, a required input missing, a link to an output a node does
    not have: `InvalidGraph`, naming node and class, teardown SKIPPED), as a comfyui pool checks
    its server's `/object_info`. `published` (the default): the `/object_info` our handler's
    workers publish in the orchestrator's bucket (`s3://{DURABLE_COMFY_BUCKET}/_durable_comfy/
    endpoints/{endpoint_id}/object_info.json`): once per worker process, at start when the
    endpoint sets DURABLE_COMFY_BUCKET, else on its first job (every durable submission names
    where). A worker re-reads it after a minute, or at once when a graph names a class it lacks,
    so a new image's registry is picked up as soon as one of its workers has published it. Until
    one has (a new endpoint, or one whose workers never got a bucket), the check is skipped with
    a log line (`node_registry_unknown`) and the job goes on: ComfyUI's own validation on the
    worker refuses a bad graph there (`PromptRejected`), after RunPod has started, and billed,
    a job for it. A path: a JSON file holding a captured `/object_info` (`curl
    http://<comfyui>/object_info > nodes.json`, from the same image; absolute, or relative to
    the worker's working directory), what a stock worker-comfyui endpoint needs, since it
    publishes nothing; read at start-up and again after a minute. `off`: no check here.
    `allowed_node_classes` (any kind): when set, the only node classes a graph may use on this
    pool; the prepare activity refuses any other class (`InvalidGraph`, naming the node) before
    anything reaches the backend. Unset: any class the backend has.
    `loader_inputs` (any kind): `{class: [input, ...]}`, the inputs of the pool's custom nodes
    that name a file of ComfyUI's input, output or temp folder, beside ComfyUI's core loaders
    (`workflows.graph.CORE_FILE_INPUTS`) and the inputs its registry marks (an upload widget,
    `image_folder`, `remote`): each must name one of the job's own input files
    (workflows/graph.py `check_input_files`). `unclassified_inputs` (any kind): what to do with
    a graph whose file inputs cannot all be told because no node registry describes its
    classes (a runpod pool before its workers publish one, or `node_registry: off`): `allow`
    (unset: the default; the rules for every value still hold: no `[output]`/`[temp]`
    annotation, no name of another job's files) or `refuse` (`InvalidGraph`: no graph without a
    registry, nor a node whose class neither it, the core loaders nor `loader_inputs` name:
    for a pool shared by tenants).

    `max_running` (any kind): at most this many of the pool's jobs hold it at once, across all
    workers, from the moment their submission may reach the pool until their prompt has
    provably ended; the others wait in our queue (`PENDING`), in order of priority, then by
    their tenants' fair shares, then first come first served. Unset: unbounded. `max_pending`:
    how many may wait at once (a new job above it is refused at submission, `QueueFull`).

    After validation a runpod pool has `url`, `api_key_env` and `claims` set; a comfyui pool has
    none of the runpod fields (so its dump is what it always was).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["comfyui", "runpod"] = "comfyui"
    url: str | None = None
    # A comfyui pool of many servers (exclusive with `url`), each holding `server_slots` jobs.
    urls: list[str] | None = Field(None, min_length=1, max_length=MAX_SERVERS)
    server_slots: int | None = Field(None, ge=1, le=64)
    endpoint_id: str | None = None
    api_key_env: str | None = None
    claims: bool | None = None
    usd_per_second: float | None = Field(None, ge=0)
    # How long a worker of the endpoint takes to start (default COLD_START_S): a waiting job's
    # estimate adds it while no worker is ready and some are starting.
    cold_start_s: float | None = Field(None, ge=0, le=3600)
    execution_timeout_s: float | None = Field(None, ge=MIN_EXECUTION_TIMEOUT_S, le=MAX_POLICY_S)
    idle_timeout_s: float | None = Field(None, ge=0)
    claim_lease_s: float | None = Field(None, ge=5, le=3600)
    fence_after_s: float | None = Field(None, ge=1, le=3600)
    status_poll_s: float | None = Field(None, ge=0.2, le=60)
    report_interval_s: float | None = Field(None, ge=0.05, le=60)
    # None means `published` (kept unset so a pool's dump is what it was given).
    node_registry: Literal["published", "off"] | Path | None = None
    allowed_node_classes: list[str] | None = None
    # None rather than empty: a pool's dump stays what it was given.
    loader_inputs: dict[str, list[str]] | None = None
    unclassified_inputs: Literal["allow", "refuse"] | None = None
    # How many of the pool's jobs may hold it at once, across every worker (our queue,
    # workflows/admission.py); None: unbounded, every job goes to the pool when it is ready.
    # At most 1,000: the holders travel in one payload when the pool's queue continues as new.
    max_running: int | None = Field(None, ge=1, le=1000)
    # How many of the pool's jobs may wait in our queue at once; above it a new one is refused
    # at submission (429 QueueFull). None: no bound of the pool's own.
    # At most 4,000, the most one pool's line holds (workflows/admission.py MAX_LINE).
    max_pending: int | None = Field(None, ge=1, le=4000)

    @field_validator("allowed_node_classes")
    @classmethod
    def _class_names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(name.strip() for name in value):
            raise ValueError("node class names must be non-empty (e.g. [KSampler, SaveImage])")
        return value

    @field_validator("loader_inputs")
    @classmethod
    def _loader_inputs(cls, value: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        if value is None:
            return value
        for class_type, names in value.items():
            if not class_type.strip() or not names or not all(n.strip() for n in names):
                raise ValueError(
                    "loader_inputs is {class: [input, ...]}, each class and input named "
                    "(e.g. {VHS_LoadVideo: [video]})"
                )
        return value

    @model_validator(mode="before")
    @classmethod
    def _hide_secrets(cls, data: Any) -> Any:
        # A key pasted where its variable's name belongs, or a URL with credentials, would be
        # echoed by every later validation error (they print the pool's input): take them out
        # before anything else, and let the validators below say what is wrong.
        if not isinstance(data, dict):
            return data
        name, url = data.get("api_key_env"), data.get("url")
        if isinstance(name, str) and (name.startswith("rpa_") or not _VARIABLE_NAME.match(name)):
            data = {**data, "api_key_env": _HIDDEN}
        # (A comfyui pool's URL is left as it always was.)
        if data.get("kind") == "runpod" and isinstance(url, str) and _has_credentials(url):
            data = {**data, "url": _HIDDEN}
        return data

    @field_validator("api_key_env")
    @classmethod
    def _variable_name(cls, value: str | None) -> str | None:
        if value is not None and not _VARIABLE_NAME.match(value):
            raise ValueError(
                "must be the NAME of the environment variable that holds the API key "
                f"(e.g. {RUNPOD_API_KEY_ENV}), never the key itself"
            )
        return value

    @field_validator("endpoint_id")
    @classmethod
    def _endpoint_id(cls, value: str | None) -> str | None:
        if value is not None and not ENDPOINT_ID_PATTERN.match(value):
            raise ValueError("not a RunPod endpoint id (letters, digits, '-' and '_' only)")
        return value

    @field_validator("urls")
    @classmethod
    def _server_urls(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        servers = [_server_url(url) for url in value]
        if len(set(servers)) != len(servers):
            raise ValueError("urls must not name a server twice")
        return servers

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> Self:
        if self.kind != "runpod":
            misplaced = [name for name in _RUNPOD_ONLY if getattr(self, name) is not None]
            if misplaced:
                raise ValueError(f"{', '.join(misplaced)}: only for pools of kind 'runpod'")
            if self.url is not None and self.urls is not None:
                raise ValueError("url and urls: a comfyui pool names one server or several")
            return self
        misplaced = [name for name in ("urls", "server_slots") if getattr(self, name) is not None]
        if misplaced:
            raise ValueError(f"{', '.join(misplaced)}: only for pools of kind 'comfyui'")
        if not self.endpoint_id:
            raise ValueError(
                "a runpod pool needs endpoint_id (the id in the endpoint's URL, "
                "https://api.runpod.ai/v2/<endpoint_id>/run)"
            )
        self.url = _api_url(self.url or RUNPOD_API_URL)
        self.api_key_env = self.api_key_env or RUNPOD_API_KEY_ENV
        if self.claims is None:
            self.claims = True
        return self

    @property
    def servers(self) -> list[str]:
        """The ComfyUI servers of a comfyui pool, in the order its settings name them."""
        if self.urls is not None:
            return list(self.urls)
        return [self.url] if self.kind == "comfyui" and self.url else []

    @property
    def assigns_servers(self) -> bool:
        """Our queue picks each job's server (a pool of `urls`, or one given `server_slots`)."""
        return self.kind == "comfyui" and (self.urls is not None or self.server_slots is not None)

    @property
    def slots_per_server(self) -> int:
        return self.server_slots or 1

    @property
    def running_bound(self) -> int | None:
        """How many of the pool's jobs may hold it at once: `max_running`, else the sum of its
        servers' slots when the queue assigns servers; None: unbounded."""
        if self.max_running is not None:
            return self.max_running
        if self.assigns_servers:
            return min(len(self.servers) * self.slots_per_server, 1000)
        return None


def _server_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL of a ComfyUI server")
    if parts.username or parts.password:
        raise ValueError("a server's URL must not carry credentials (it is shown in statuses)")
    return value.rstrip("/")


def _has_credentials(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return bool(parts.username or parts.password)


def _api_url(value: str) -> str:
    if value == _HIDDEN:
        raise ValueError("url must not carry credentials: the key comes from api_key_env")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be an http(s) URL (RunPod's API base, e.g. {RUNPOD_API_URL})")
    return value.rstrip("/")
