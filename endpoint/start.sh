#!/usr/bin/env bash
# The worker's entry point in the image: ComfyUI in the background, the handler, and beside it
# the watchdog that ends the worker when the handler holds a claim it no longer renews
# (endpoint/watchdog.py). The handler waits for ComfyUI without a cap while COMFY_PID lives,
# so a slow cold start is not a failed job.
#
# The handler runs as this script's child rather than exec'd in its place: in a container
# without an init this script is PID 1, and the kernel ignores a SIGKILL sent to PID 1 from
# inside its own namespace, so the watchdog could not end an exec'd handler. As a child it can:
# when the handler exits (or is killed), this script exits once the watchdog has too, and so
# does the container.
set -euo pipefail

# tcmalloc, as worker-comfyui's start script: less fragmentation in long-lived torch processes.
TCMALLOC="$(ldconfig -p 2>/dev/null | grep -Po 'libtcmalloc.so.\d' | head -n 1 || true)"
if [ -n "${TCMALLOC}" ]; then export LD_PRELOAD="${TCMALLOC}"; fi

# Where things are in the image (overridable to try this script elsewhere).
ENDPOINT_PYTHON="${ENDPOINT_PYTHON:-/opt/endpoint-venv/bin/python}"
ENDPOINT_HANDLER="${ENDPOINT_HANDLER:-/durable_comfy/endpoint/handler.py}"
ENDPOINT_WATCHDOG="${ENDPOINT_WATCHDOG:-/durable_comfy/endpoint/watchdog.py}"
COMFY_MAIN="${COMFY_MAIN:-/comfyui/main.py}"

COMFY_PORT="${COMFY_PORT:-8188}"
# shellcheck disable=SC2086  # COMFY_ARGS is a list of flags
"${COMFY_PYTHON:-python}" -u "${COMFY_MAIN}" --listen 127.0.0.1 --port "${COMFY_PORT}" \
    --disable-auto-launch --log-stdout ${COMFY_ARGS:-} &
export COMFY_PID=$!
export COMFY_URL="${COMFY_URL:-http://127.0.0.1:${COMFY_PORT}}"
export DURABLE_COMFY_FENCE_FILE="${DURABLE_COMFY_FENCE_FILE:-/tmp/durable-comfy-fence.json}"

"${ENDPOINT_PYTHON}" -u "${ENDPOINT_HANDLER}" "$@" &
HANDLER_PID=$!
# A session of its own: nothing sent to the handler's process group reaches the watchdog.
setsid "${ENDPOINT_PYTHON}" -u "${ENDPOINT_WATCHDOG}" --pid "${HANDLER_PID}" &
WATCHDOG_PID=$!

# The platform's stop (and a Ctrl-C) is a SIGTERM to the handler: the SDK's graceful shutdown.
# (A background job of a script ignores SIGINT, so that would not do.)
trap 'kill -TERM "${HANDLER_PID}" 2>/dev/null || true' TERM INT
status=0
while :; do
    wait "${HANDLER_PID}" && status=0 || status=$?
    # A trapped signal ends `wait` early: wait again while the handler lives.
    kill -0 "${HANDLER_PID}" 2>/dev/null || break
done
# The watchdog follows the handler out within half a second; one that has just killed a frozen
# handler whose prompt had finished first stores its outputs (by the lease's end and
# fence_after_s), so the container, and its ComfyUI, live until it is done.
while kill -0 "${WATCHDOG_PID}" 2>/dev/null; do
    wait "${WATCHDOG_PID}" 2>/dev/null || true
done
exit "${status}"
