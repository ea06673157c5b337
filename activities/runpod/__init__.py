"""Everything that talks to a RunPod serverless endpoint, one module per concern. The wire
contract with our handler, which both sides import, is `protocol/runpod/contract.py`.

    errors.py    the exception tree `RunPodClient` raises (translated from httpx at its edge)
    models.py    the public API's answers as typed models, and the `/run` policy with its ranges
    retry.py     the client's own bounded, jittered waits for 429 / 5xx, and `Retry-After`
    client.py    `RunPodClient`: run, status, stream, cancel, retry, purge_queue, health
    outcome.py   pure reading of a `/status` answer: queued, running, succeeded, follow the claim
                 holder, or a typed failure
    failures.py  the one place RunPod errors and failed outcomes become `ApplicationError`s
    nodes.py     the endpoint's node registry (published by its workers, or a captured file)
                 that prepare checks a graph against before any RunPod job exists
    submissions.py  the registry of live submissions in the bucket, for the orphan sweep

Import from the modules themselves; this file imports nothing, like `activities.comfyui`.
"""
