# The orchestrator's two images, from one installed project (docs/images.md): the worker
# (`durable-comfy worker`: the Temporal worker that runs InferenceJob and its activities) and the
# HTTP gateway (`durable-comfy gateway`: the HTTP API and its page, a client of Temporal and of
# the bucket). No GPU and no ComfyUI in either: they reach ComfyUI pools, RunPod and S3 over the
# network. Build from the repository root:
#
#   docker build --target worker -t REGISTRY/durable-comfy-worker:TAG .
#   docker build --target gateway -t REGISTRY/durable-comfy-gateway:TAG .
#
# `worker` is the last stage, so a plain `docker build .` builds the worker. The RunPod handler's
# image is endpoint/Dockerfile.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS project

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
# throwaway build environment. The sources stay root-owned and read-only to the images' user.
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

# Not root in either image: both only make outbound connections and listen on an unprivileged
# port. A home of its own, for Temporal's optional config file and caches.
RUN useradd --create-home --no-log-init --uid 10001 --user-group durable
WORKDIR /home/durable


FROM project AS gateway

# The `gateway` extra's pins (constraints/gateway.txt: FastAPI, uvicorn and what they add), with
# --no-deps as the worker's: `pip check` fails the build if the two lists are not complete and
# consistent together. After the project, so that both images share every layer above.
COPY constraints/gateway.txt /opt/durable-comfy/constraints/gateway.txt
RUN pip install --no-deps --requirement /opt/durable-comfy/constraints/gateway.txt \
    && pip check
USER 10001:10001

# On every interface of the container, port 8080. The gateway refuses to listen beyond
# loopback without API keys (DURABLE_COMFY_API_KEYS or DURABLE_COMFY_API_KEYS_FILE): give it
# them, Temporal's address or profile and the bucket's settings (docs/deploy.md). The health
# check asks /healthz, which answers while the process serves (/readyz also needs Temporal).
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]

ENTRYPOINT ["durable-comfy", "gateway", "--host", "0.0.0.0", "--port", "8080"]


FROM project AS worker
USER 10001:10001

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
