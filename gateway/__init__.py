"""The HTTP face of the jobs (docs/http-api.md): a stateless ASGI app built on `JobClient`."""
