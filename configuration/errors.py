"""Every exception the configuration raises: a setting, a file or a key ring that cannot be used.

    pydantic_settings.SettingsError
    └── ConfigFileError       the production file is unusable (names the file and the key's path)
    CodecError                base of the payload codec's errors (starter.codec raises the rest)
    ├── CodecSettingsError    the key ring cannot be built (names the variable or file)
    ├── UnknownKeyId          a payload was encrypted with a key the ring does not hold
    └── DecryptionFailed      the payload does not decrypt with its key (tampered or truncated)

A settings class's own problem is pydantic's `ValidationError`, located at the variable.
The codec's tree is here whole, the payloads' errors with the key ring's, so that every
`except CodecError` catches a bad setting too. Bad S3 settings raise workflows.errors'
`StorageConfigError`: a storage error, as S3 refusing the credentials is.
None of these messages ever quotes a secret.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class CodecError(Exception):
    """Base of the codec's errors."""


class CodecSettingsError(CodecError, ValueError):
    """The key ring cannot be built from the configuration; says which variable and entry."""


class UnknownKeyId(CodecError):
    """The payload names a key the ring does not hold (rotated out, or another deployment's)."""

    def __init__(self, key_id: str, known: Sequence[str], *, where: str) -> None:
        super().__init__(
            f"payload encrypted with key id {key_id!r}, which is not in the key ring "
            f"(ids: {', '.join(known)}): add that key to {where} after the active one"
        )
        self.key_id = key_id


class DecryptionFailed(CodecError):
    """AES-GCM authentication failed: the payload was altered, truncated or mislabelled."""

    def __init__(self, key_id: str, why: str) -> None:
        super().__init__(f"payload with key id {key_id!r} does not decrypt: {why}")
        self.key_id = key_id
