"""Payload encryption: an AES-256-GCM `PayloadCodec` and the key ring it encrypts with.

Turned on by configuration, read from the environment (docs/security.md):

    DURABLE_COMFY_CODEC_KEYS       comma-separated `ID:BASE64KEY` entries, newest first
    DURABLE_COMFY_CODEC_KEYS_FILE  a file with the same entries, one per line (`#` comments)

Set one of them, never both. Below them, the production configuration file
(DURABLE_COMFY_SETTINGS_FILE) may name a key file as `codec.keys_file`; either variable replaces
it (the key ring is one setting), and the file never holds a key. The variables are read by
configuration.settings.CodecSettings, the ring parsed by configuration.codec_keys.KeyRing.

Each key is 32 random bytes in standard base64 (`durable-comfy codec new-key ID` prints an
entry: `new_entry` below). The first entry is the active key: it encrypts every new payload.
Every entry decrypts. Rotating is putting a new entry first and keeping the old ones for as long
as histories encrypted with them must be read.

An encrypted payload carries `encoding: binary/encrypted` and `encryption-key-id: ID` in its
metadata (in clear: the key id is not a secret) and `nonce (12 bytes) || ciphertext || tag` as
its data, the plaintext being the whole original payload (metadata included). The key id is the
associated data, so a payload cannot be passed off as another key's.

Errors (configuration.errors'; none of them ever carries key material):

    CodecError
    ├── CodecSettingsError  the key ring's configuration is unusable (names the variable)
    ├── UnknownKeyId        a payload was encrypted with a key the ring does not hold
    └── DecryptionFailed    the payload does not decrypt with its key (tampered or truncated)
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

from configuration.codec_keys import KEY_ID_PATTERN, KEYS_ENV, KEYS_FILE_ENV, KeyRing
from configuration.errors import CodecSettingsError, DecryptionFailed, UnknownKeyId
from configuration.settings import CodecSettings

ENCODING = b"binary/encrypted"
KEY_ID_METADATA = "encryption-key-id"
NONCE_BYTES = 12
TAG_BYTES = 16
# Where a key the ring lacks is added, as an unknown key id's error says.
RING_VARIABLES = f"{KEYS_ENV} (or the file {KEYS_FILE_ENV} names)"


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
            raise UnknownKeyId(key_id, self.ring.ids, where=RING_VARIABLES)
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
