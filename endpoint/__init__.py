"""The RunPod serverless handler that runs inside a GPU worker next to ComfyUI.

It has its own requirements (`endpoint/requirements.txt`, the `runpod` SDK) and its own venv:
the orchestrator's venv cannot hold `runpod` (boto3 pins). `contract.py` is shared with the
orchestrator and needs only pydantic (and `activities/keys.py`, stdlib only).
"""
