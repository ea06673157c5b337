"""Payload encryption: an AES-256-GCM `PayloadCodec` and the key ring it encrypts with.

Turned on by configuration, read from the environment (docs/security.md):

    DURABLE_COMFY_CODEC_KEYS       comma-separated `ID:BASE64KEY` entries, newest first
    DURABLE_COMFY_CODEC_KEYS_FILE  a file with the same entries, one per line (`#` comments)

Set one of them, never both. Below them, the production configuration file
(DURABLE_COMFY_SETTINGS_FILE, `activities.config_file`) may name a key file as `codec.keys_file`;
either variable replaces it (the key ring is one setting), and the file never holds a key.

Each key is 32 random bytes in standard base64 (`durable-comfy codec new-key ID` prints an
entry: `new_entry` below). The first entry is the active key: it encrypts every new payload.
Every entry decrypts. Rotating is putting a new entry first and keeping the old ones for as long
as histories encrypted with them must be read.

An encrypted payload carries `encoding: binary/encrypted` and `encryption-key-id: ID` in its
metadata (in clear: the key id is not a secret) and `nonce (12 bytes) || ciphertext || tag` as
its data, the plaintext being the whole original payload (metadata included). The key id is the
associated data, so a payload cannot be passed off as another key's.

Errors (none of them ever carries key material):

    CodecError
    ├── CodecSettingsError  the key ring's configuration is unusable (names the variable)
    ├── UnknownKeyId        a payload was encrypted with a key the ring does not hold
    └── DecryptionFailed    the payload does not decrypt with its key (tampered or truncated)
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import Field, SecretStr, ValidationError, create_model
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

from activities.config_file import ConfigFileError, file_named
from starter.variables import VariablesOnly

KEYS_ENV = "DURABLE_COMFY_CODEC_KEYS"
KEYS_FILE_ENV = "DURABLE_COMFY_CODEC_KEYS_FILE"
# The codec server's bearer token unless `--auth-token-env` names another variable.
TOKEN_ENV = "DURABLE_COMFY_CODEC_AUTH_TOKEN"

ENCODING = b"binary/encrypted"
KEY_ID_METADATA = "encryption-key-id"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
NEW_KEY_HINT = "`durable-comfy codec new-key ID` prints a fresh entry"


class CodecError(Exception):
    """Base of the codec's errors."""


class CodecSettingsError(CodecError, ValueError):
    """The key ring cannot be built from the configuration; says which variable and entry."""


class UnknownKeyId(CodecError):
    """The payload names a key the ring does not hold (rotated out, or another deployment's)."""

    def __init__(self, key_id: str, known: Sequence[str]) -> None:
        super().__init__(
            f"payload encrypted with key id {key_id!r}, which is not in the key ring "
            f"(ids: {', '.join(known)}): add that key to {KEYS_ENV} (or the file "
            f"{KEYS_FILE_ENV} names) after the active one"
        )
        self.key_id = key_id


class DecryptionFailed(CodecError):
    """AES-GCM authentication failed: the payload was altered, truncated or mislabelled."""

    def __init__(self, key_id: str, why: str) -> None:
        super().__init__(f"payload with key id {key_id!r} does not decrypt: {why}")
        self.key_id = key_id


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


class CodecSettings(VariablesOnly):
    """DURABLE_COMFY_CODEC_KEYS or DURABLE_COMFY_CODEC_KEYS_FILE; neither: no encryption."""

    keys: SecretStr | None = Field(None, validation_alias=KEYS_ENV)
    keys_file: Path | None = Field(None, validation_alias=KEYS_FILE_ENV)

    # The production file may name the key file (never hold a key): one setting with the two
    # variables, so either of them replaces it rather than clashing with it.
    file_keys: ClassVar[Mapping[str, str]] = {"keys_file": "codec.keys_file"}
    file_keys_exclusive: ClassVar[bool] = True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> CodecSettings:
        """From `environ` alone when given (as `connect_temporal` takes it), else the process's.

        A production file that cannot be used is a `CodecSettingsError` naming it."""
        try:
            if environ is None:
                return cls()
            names = (KEYS_ENV, KEYS_FILE_ENV)
            values = {name: environ[name] for name in names if environ.get(name)}
            if not values and (config := file_named(environ)) is not None:
                if config.codec.keys_file is not None:
                    values[KEYS_FILE_ENV] = str(config.codec.keys_file)
            return cls.model_validate(values)
        except ConfigFileError as exc:
            raise CodecSettingsError(str(exc)) from None
        except ValidationError as exc:
            raise CodecSettingsError(
                "; ".join(
                    f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
                    for error in exc.errors()
                )
            ) from None

    def key_ring(self) -> KeyRing | None:
        """The ring, or None when no key is configured; `CodecSettingsError` if unusable."""
        if self.keys is not None and self.keys_file is not None:
            raise CodecSettingsError(f"set {KEYS_ENV} or {KEYS_FILE_ENV}, not both")
        if self.keys is not None:
            return KeyRing.parse(self.keys.get_secret_value(), KEYS_ENV)
        if self.keys_file is None:
            return None
        try:
            text = self.keys_file.read_text()
        except OSError as exc:
            raise CodecSettingsError(
                f"{KEYS_FILE_ENV}: cannot read {self.keys_file}: {exc.strerror}"
            ) from None
        return KeyRing.parse(text, f"{KEYS_FILE_ENV} ({self.keys_file})")


class CodecServerSettings(VariablesOnly):
    """`durable-comfy codec-server`'s own variables: its log level and its bearer token."""

    log_level: str = Field("INFO", validation_alias="DURABLE_COMFY_LOG_LEVEL")
    auth_token: SecretStr | None = Field(None, validation_alias=TOKEN_ENV)

    @classmethod
    def load(cls, token_env: str | None = None) -> CodecServerSettings:
        """With `token_env`, the token is read from that variable instead of TOKEN_ENV."""
        if token_env is None:
            return cls()
        named = create_model(
            "CodecServerSettings",
            __base__=cls,
            auth_token=(SecretStr | None, Field(None, validation_alias=token_env)),
        )
        return named()


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM over whole payloads, with a fresh random 96-bit nonce for each."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring
        self._ciphers = {key_id: AESGCM(key) for key_id, key in ring.keys.items()}

    @property
    def active_id(self) -> str:
        return self.ring.active_id

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]

    def encrypt(self, payload: Payload) -> Payload:
        key_id = self.ring.active_id
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._ciphers[key_id].encrypt(nonce, payload.SerializeToString(), key_id.encode())
        return Payload(
            metadata={"encoding": ENCODING, KEY_ID_METADATA: key_id.encode()},
            data=nonce + sealed,
        )

    def decrypt(self, payload: Payload) -> Payload:
        """An encrypted payload's original; any other payload as it is (written before the
        codec was turned on, or a search attribute)."""
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        raw_id = payload.metadata.get(KEY_ID_METADATA)
        if raw_id is None:
            raise DecryptionFailed("(none)", f"no {KEY_ID_METADATA} in its metadata")
        key_id = raw_id.decode("utf-8", "replace")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise UnknownKeyId(key_id, self.ring.ids)
        if len(payload.data) < NONCE_BYTES + TAG_BYTES:
            raise DecryptionFailed(key_id, f"{len(payload.data)} bytes is too short")
        nonce, sealed = payload.data[:NONCE_BYTES], payload.data[NONCE_BYTES:]
        try:
            plain = cipher.decrypt(nonce, sealed, raw_id)
        except InvalidTag:
            raise DecryptionFailed(key_id, "authentication tag mismatch") from None
        original = Payload()
        original.ParseFromString(plain)
        return original


def new_entry(key_id: str) -> str:
    """A fresh `ID:BASE64KEY` entry (32 bytes from the OS's CSPRNG)."""
    if not KEY_ID_PATTERN.match(key_id):
        raise CodecSettingsError("the key id must be 1-64 of A-Z a-z 0-9 . _ -")
    return f"{key_id}:{base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()}"


def codec_from_environ(environ: Mapping[str, str] | None = None) -> EncryptionCodec | None:
    """The codec the configuration asks for, or None; `CodecSettingsError` if it is unusable."""
    ring = CodecSettings.from_environ(environ).key_ring()
    return None if ring is None else EncryptionCodec(ring)
