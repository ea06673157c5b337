# The orchestrator's worker (`durable-comfy worker`): the Temporal worker that runs InferenceJob
# and its activities. No GPU and no ComfyUI here: it reaches ComfyUI pools, RunPod and S3 over
# the network. Build from the repository root (docs/images.md):
#
#   docker build -t REGISTRY/durable-comfy-worker:TAG .
#
# The RunPod handler's image is endpoint/Dockerfile.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:${PATH}

# The dependencies first (a layer that changes only with the pins): constraints/worker.txt holds
# every runtime requirement pinned, transitively, without extras (no server binaries, no dev
# tools; how to regenerate it is written at its top). --no-deps installs exactly that list, and
# `pip check` fails the build if it is not complete and consistent.
COPY constraints/worker.txt /opt/durable-comfy/constraints/worker.txt
RUN python -m venv /opt/venv \
    && pip install --no-deps --requirement /opt/durable-comfy/constraints/worker.txt \
    && pip check

# The project as `pip install .` builds it: pyproject's packages (the CLI loads the `worker` and
# `dev` commands of every installed package at start, so the whole distribution goes in), with
# --no-deps, so nothing unpinned is resolved. setuptools, the build backend, lives only in pip's
# throwaway build environment. The sources stay root-owned and read-only to the worker's user.
COPY pyproject.toml README.md worker.py /opt/durable-comfy/src/
COPY workflows/ /opt/durable-comfy/src/workflows/
COPY protocol/ /opt/durable-comfy/src/protocol/
COPY configuration/ /opt/durable-comfy/src/configuration/
COPY activities/ /opt/durable-comfy/src/activities/
COPY starter/ /opt/durable-comfy/src/starter/
COPY gateway/ /opt/durable-comfy/src/gateway/
COPY devstack/ /opt/durable-comfy/src/devstack/
COPY endpoint/ /opt/durable-comfy/src/endpoint/
RUN pip install --no-deps /opt/durable-comfy/src \
    && pip check \
    && rm -rf /opt/durable-comfy/src/build /opt/durable-comfy/src/*.egg-info

# Not root: the worker needs no privilege (it only makes outbound connections and serves metrics
# on an unprivileged port). A home of its own, for Temporal's optional config file and caches.
RUN useradd --create-home --no-log-init --uid 10001 --user-group durable
USER 10001:10001
WORKDIR /home/durable

# Prometheus metrics (Temporal's and the project's) on 0.0.0.0:9464/metrics, so a scraper
# outside the container reaches them once the port is exposed to it (the worker's default
# outside a container is 127.0.0.1). The health check asks /metrics, which answers once the
# worker's Temporal runtime is up; a worker that cannot connect to Temporal exits.
ENV DURABLE_COMFY_METRICS_PORT=9464 \
    DURABLE_COMFY_METRICS_HOST=0.0.0.0
EXPOSE 9464
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ['DURABLE_COMFY_METRICS_PORT']}/metrics\", timeout=4)"]

# Settings come from a mounted settings file named by DURABLE_COMFY_SETTINGS_FILE
# (examples/production.yaml) and the environment (docs/configuration.md, docs/deploy.md):
# Temporal's profile or TEMPORAL_ADDRESS, and the secrets, which never go in the file.
ENTRYPOINT ["durable-comfy", "worker"]
