"""The RunPod serverless handler that runs inside a GPU worker next to ComfyUI.

It has its own requirements (`endpoint/requirements.txt`, the `runpod` SDK) and its own venv:
the orchestrator's venv cannot hold `runpod` (boto3 pins). It imports from the orchestrator only
what needs neither Temporal nor the worker: the ComfyUI core (`protocol.comfyui.client`,
`events`, `follower`, `history`), `protocol.progress`, `protocol.keys`, and the wire contract
(`protocol.runpod.contract`). Nothing under `activities/` imports `endpoint/`
(tests/test_layers.py).
"""
