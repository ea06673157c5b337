"""Everything that talks to ComfyUI, one module per concern.

    client.py      `ComfyClient`: the HTTP API of one ComfyUI server, errors translated at the edge
    events.py      WebSocket frames as typed events; outputs and endings read from history
    graph.py       a graph checked against the backend's node registry (`/object_info`)
    pools.py       `ComfyPools` (pool name -> client) and `PoolHealth` (unhealthy, busy pools)
    activities.py  `ComfyActivities`: prepare, stop (one check)
    whereabouts.py where a prompt is (in line and its place, running, finished), by the jobs
                   API where ComfyUI has it, not /queue (which sends every queued graph)
    follower.py    `PromptFollower`: the protocol of following one prompt (submit unless known,
                   reconcile, reopen, lost rechecks), told to a `FollowListener`; Temporal-free,
                   shared with the RunPod handler (endpoint/execution.py)
    history.py     a prompt's history entry once written, and the outputs it names
    follow.py      `FollowActivities` and `FollowAttempt`, the orchestrator's listener:
                   heartbeats, progress signals, uploads as nodes finish
    offload.py     `OffloadActivities` and `OutputUploader`: outputs stored in S3, each once

Import from the modules themselves; this file imports nothing, so `activities.errors` can use
the client's exceptions without pulling in the activities, and the handler's venv (no Temporal)
can import client, events, follower and history.
"""
