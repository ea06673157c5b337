"""The client library and the `durable-comfy` CLI (starter/): unit tests, the time-skipping server
(`env`, tests/conftest.py), and commands run against the local stack with a worker per module
(`local_stack`, `worker`, tests/conftest.py; tests/support/cli.py runs the CLI)."""
