"""The `comfyui` pool's activities: ComfyUI servers reached directly over HTTP and WebSocket.

    graph.py       a graph checked against the backend's node registry (`/object_info`)
    registry.py    the node registries, cached per pool
    pools.py       `ComfyPools` (pool name -> client) and `PoolHealth` (unhealthy, busy pools)
    activities.py  `ComfyActivities`: prepare, stop (one check)
    follow.py      `FollowActivities` and `FollowAttempt`, the orchestrator's listener to the
                   protocol core's `PromptFollower`: heartbeats, progress signals, uploads as
                   nodes finish
    offload.py     `OffloadActivities` and `OutputUploader`: outputs stored in S3, each once
    backend.py     the pool kind's activities gathered for the worker

The protocol itself (client, events, follower, history) lives in `protocol/comfyui/`, which the
RunPod handler shares. Import from the modules themselves; this file imports nothing.
"""
