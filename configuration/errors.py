"""Every exception the configuration raises: a setting, a file or a key ring that cannot be used.

    pydantic_settings.SettingsError
    └── ConfigFileError       the production file is unusable (names the file and the key's path)
    StorageError              base of the storage errors (activities.storage_errors adds the rest)
    └── StorageConfigError    S3 settings missing or invalid (or, from S3, credentials refused)
    CodecError                base of the payload codec's errors (starter.codec adds the rest)
    └── CodecSettingsError    the key ring cannot be built (names the variable or file)

A settings class's own problem is pydantic's `ValidationError`, located at the variable.
The storage and codec bases are defined here, not beside the code that raises their other
errors, because settings raise them too and every `except StorageError` / `except CodecError`
must keep catching a bad setting; their modules import them from here.
None of these messages ever quotes a secret.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError
from pydantic_core import PydanticCustomError
from pydantic_settings import SettingsError

# The production file's variable, as every message about the file names it (configuration.files).
FILE_VAR = "DURABLE_COMFY_SETTINGS_FILE"


class ConfigFileError(SettingsError):
    """The production file is unusable: says which file, which key, and what to do."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path} ({FILE_VAR}): {problem}")
        self.path = path
        self.problem = problem

    def as_validation_error(self, title: str) -> ValidationError:
        """The same problem as a settings class's `ValidationError`, located at the file's
        variable, as a bad variable is: every caller already reports those (exit 2, etc.)."""
        error = PydanticCustomError(
            "config_file", "{message}", {"message": f"{self.path}: {self.problem}"}
        )
        return ValidationError.from_exception_data(
            title, [{"type": error, "loc": (FILE_VAR,), "input": None}], hide_input=True
        )


class StorageError(Exception):
    retryable: bool = True

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class StorageConfigError(StorageError):
    retryable = False


class CodecError(Exception):
    """Base of the codec's errors."""


class CodecSettingsError(CodecError, ValueError):
    """The key ring cannot be built from the configuration; says which variable and entry."""
