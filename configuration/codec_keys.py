"""The payload codec's key ring and the variables that configure it (docs/security.md).

    DURABLE_COMFY_CODEC_KEYS       comma-separated `ID:BASE64KEY` entries, newest first
    DURABLE_COMFY_CODEC_KEYS_FILE  a file with the same entries, one per line (`#` comments)

Parsing only: the codec that encrypts with the ring is starter.codec, the settings that read
these variables (and the production file's `codec.keys_file`) configuration.settings.CodecSettings.
No error quotes a key.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass

from configuration.errors import CodecSettingsError

KEYS_ENV = "DURABLE_COMFY_CODEC_KEYS"
KEYS_FILE_ENV = "DURABLE_COMFY_CODEC_KEYS_FILE"
# The codec server's bearer token unless `--auth-token-env` names another variable.
TOKEN_ENV = "DURABLE_COMFY_CODEC_AUTH_TOKEN"

KEY_BYTES = 32
KEY_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
NEW_KEY_HINT = "`durable-comfy codec new-key ID` prints a fresh entry"


@dataclass(frozen=True)
class KeyRing:
    """Keys by id; `active_id` encrypts, every key decrypts."""

    active_id: str
    keys: Mapping[str, bytes]

    def __post_init__(self) -> None:
        if self.active_id not in self.keys:
            raise CodecSettingsError(f"active key id {self.active_id!r} is not in the ring")
        for key_id, key in self.keys.items():
            if len(key) != KEY_BYTES:
                raise CodecSettingsError(
                    f"key {key_id!r} is {len(key)} bytes; AES-256 keys are {KEY_BYTES}"
                )

    @property
    def ids(self) -> list[str]:
        return list(self.keys)

    def __repr__(self) -> str:  # a dataclass repr would print the keys
        return f"KeyRing(active_id={self.active_id!r}, ids={self.ids!r})"

    @classmethod
    def parse(cls, text: str, source: str) -> KeyRing:
        """Entries `ID:BASE64KEY`, separated by commas or lines; `#` starts a comment.

        `source` (a variable or file name) is what errors name; no error quotes a key.
        """
        entries: list[str] = []
        for line in text.splitlines():
            entries += [e.strip() for e in line.split("#", 1)[0].split(",") if e.strip()]
        if not entries:
            raise CodecSettingsError(f"{source} holds no key entries (expected ID:BASE64KEY)")
        keys: dict[str, bytes] = {}
        for position, entry in enumerate(entries, start=1):
            key_id, sep, encoded = entry.partition(":")
            key_id = key_id.strip()
            where = f"{source}: entry {position}"
            if not sep:
                raise CodecSettingsError(f"{where} is not ID:BASE64KEY (no ':')")
            if not KEY_ID_PATTERN.match(key_id):
                raise CodecSettingsError(
                    f"{where}: the key id must be 1-64 of A-Z a-z 0-9 . _ -"
                    " (the key id is stored in clear in every payload)"
                )
            where = f"{source}: key {key_id!r}"
            if key_id in keys:
                raise CodecSettingsError(f"{where} appears twice")
            try:
                key = base64.b64decode(encoded.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise CodecSettingsError(
                    f"{where} is not standard base64 ({NEW_KEY_HINT})"
                ) from None  # the cause could quote the material
            if len(key) != KEY_BYTES:
                raise CodecSettingsError(
                    f"{where} decodes to {len(key)} bytes; AES-256-GCM needs {KEY_BYTES}"
                    f" ({NEW_KEY_HINT})"
                )
            keys[key_id] = key
        return cls(active_id=next(iter(keys)), keys=keys)
