#!/usr/bin/env bash
# The worker's entry point in the image: ComfyUI in the background, then the handler in the
# foreground (it receives the platform's SIGTERM). The handler waits for ComfyUI without a cap
# while COMFY_PID lives, so a slow cold start is not a failed job.
set -euo pipefail

# tcmalloc, as worker-comfyui's start script: less fragmentation in long-lived torch processes.
TCMALLOC="$(ldconfig -p 2>/dev/null | grep -Po 'libtcmalloc.so.\d' | head -n 1 || true)"
if [ -n "${TCMALLOC}" ]; then export LD_PRELOAD="${TCMALLOC}"; fi

COMFY_PORT="${COMFY_PORT:-8188}"
# shellcheck disable=SC2086  # COMFY_ARGS is a list of flags
"${COMFY_PYTHON:-python}" -u /comfyui/main.py --listen 127.0.0.1 --port "${COMFY_PORT}" \
    --disable-auto-launch --log-stdout ${COMFY_ARGS:-} &
export COMFY_PID=$!
export COMFY_URL="${COMFY_URL:-http://127.0.0.1:${COMFY_PORT}}"

exec /opt/endpoint-venv/bin/python -u /durable_comfy/endpoint/handler.py "$@"
