"""Errors of the local stack launcher.

StackError                  anything `dev up|down|status` cannot do; the message is for people
├── PortInUseError          a configured port is taken by something that is not ours
├── ServiceStartError       a service exited or never answered its health probe in time
└── ServiceStopError        a service outlived SIGTERM and SIGKILL
"""

from __future__ import annotations


class StackError(Exception):
    """Base class; `hint` says what the user can do about it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class PortInUseError(StackError):
    def __init__(self, service: str, config_key: str, host: str, port: int) -> None:
        super().__init__(
            f"port {port} on {host} ({config_key}, needed by {service}) is already in use",
            hint=f"stop whatever listens on {host}:{port} or change {config_key} in the config",
        )
        self.service = service
        self.config_key = config_key
        self.host = host
        self.port = port


class ServiceStartError(StackError):
    def __init__(self, service: str, reason: str, log_file: str, log_tail: str) -> None:
        super().__init__(
            f"{service} did not start: {reason}\n--- last lines of {log_file} ---\n{log_tail}",
            hint=f"see {log_file}",
        )
        self.service = service
        self.log_file = log_file


class ServiceStopError(StackError):
    pass
