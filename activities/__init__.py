"""All I/O of durable-comfy: ComfyUI over HTTP and WebSocket, S3, teardown.

Activities are methods of classes that receive their clients and settings, built once by the
worker (see `worker.py`).
"""
