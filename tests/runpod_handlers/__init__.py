"""Tiny RunPod handlers for the simulator's tests, each a script run by .venv-endpoint's python
under the real `runpod.serverless.start` loop (the app venv cannot import runpod)."""
