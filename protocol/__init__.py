"""The protocol core: how durable-comfy speaks to ComfyUI and to its RunPod handler.

    comfyui/client.py      `ComfyClient`: the HTTP API of one ComfyUI server, errors translated at
                           the edge
    comfyui/events.py      WebSocket frames as typed events; endings read from history
    comfyui/follower.py    `PromptFollower`: following one prompt (submit unless known, reconcile,
                           reopen, lost rechecks), told to a `FollowListener`
    comfyui/history.py     a prompt's history entry once written, and the outputs it names
    comfyui/socket.py      the `/ws` connection; silence.py, the watch on a quiet socket;
                           whereabouts.py, where a prompt is (queued, running, finished)
    runpod/contract.py     the wire contract between the orchestrator and our RunPod handler
    keys.py                object keys and safe names for jobs' files
    progress.py            `ProgressTracker`: which progress is worth reporting
    multipart.py           the streamed multipart upload both sides store outputs with
    s3_answers.py          what an S3 error answer means (missing, conflict, access, busy)
    errors.py              every exception of the core's own (each side maps them at its edge)

Two sides import it: the worker's activities (`activities/`) and the RunPod handler (`endpoint/`),
which runs in a venv without Temporal. So nothing here imports Temporal or any other folder of
the project (tests/test_layers.py checks both). Import from the modules themselves.
"""
