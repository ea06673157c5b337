"""The payload codec (starter/codec.py): AES-GCM round trip, rotation, unknown keys, tampering,
and key material that must stop the worker and the CLI at start-up without being echoed."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.api.common.v1 import Payload

from configuration.codec_keys import KEYS_ENV, KEYS_FILE_ENV, KeyRing
from configuration.errors import CodecSettingsError, DecryptionFailed, UnknownKeyId
from configuration.settings import CodecSettings, TemporalSettings
from starter.codec import ENCODING, KEY_ID_METADATA, EncryptionCodec, codec_from_environ, new_entry
from starter.connection import data_converter
from tests.support.cli import example
from workflows.contracts import JobRequest

SECRET_MARKER = "marker-3f9a1c"


def key_b64() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def ring(*ids: str) -> tuple[KeyRing, str]:
    """A ring of fresh keys in this order, and its text."""
    text = ",".join(f"{key_id}:{key_b64()}" for key_id in ids)
    return KeyRing.parse(text, KEYS_ENV), text


def plain_payload(text: str = SECRET_MARKER) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=f'"{text}"'.encode())


async def test_round_trip_hides_payload_and_metadata_and_labels_the_key() -> None:
    codec = EncryptionCodec(ring("k2", "k1")[0])
    original = plain_payload()
    [sealed] = await codec.encode([original])
    assert dict(sealed.metadata) == {"encoding": ENCODING, KEY_ID_METADATA: b"k2"}
    assert SECRET_MARKER.encode() not in sealed.data
    assert b"json/plain" not in sealed.data  # the original metadata is encrypted too
    [back] = await codec.decode([sealed])
    assert back == original


async def test_every_payload_gets_its_own_nonce() -> None:
    codec = EncryptionCodec(ring("k1")[0])
    first, second = await codec.encode([plain_payload(), plain_payload()])
    assert first.data[:12] != second.data[:12]
    assert first.data != second.data


async def test_rotation_new_key_encrypts_old_key_still_decrypts() -> None:
    old_ring, old_text = ring("old")
    [sealed_old] = await EncryptionCodec(old_ring).encode([plain_payload()])
    new_id_entry = new_entry("new")
    rotated = codec_from_environ({KEYS_ENV: f"{new_id_entry},{old_text}"})
    assert rotated is not None and rotated.active_id == "new"
    assert (await rotated.decode([sealed_old]))[0] == plain_payload()
    [sealed_new] = await rotated.encode([plain_payload()])
    assert sealed_new.metadata[KEY_ID_METADATA] == b"new"


async def test_unknown_key_id_is_typed_and_names_the_id_never_a_key() -> None:
    foreign, foreign_text = ring("retired")
    [sealed] = await EncryptionCodec(foreign).encode([plain_payload()])
    ours, ours_text = ring("current")
    with pytest.raises(UnknownKeyId) as caught:
        await EncryptionCodec(ours).decode([sealed])
    assert caught.value.key_id == "retired"
    assert "'retired'" in str(caught.value) and "current" in str(caught.value)
    for text in (foreign_text, ours_text):
        assert text.split(":", 1)[1] not in str(caught.value)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda p: p.data[:-1] + bytes([p.data[-1] ^ 1]),  # the tag
        lambda p: p.data[:20] + bytes([p.data[20] ^ 1]) + p.data[21:],  # the ciphertext
        lambda p: bytes([p.data[0] ^ 1]) + p.data[1:],  # the nonce
        lambda p: p.data[:27],  # truncated below nonce + tag
    ],
    ids=["tag", "ciphertext", "nonce", "truncated"],
)
async def test_tampered_ciphertext_fails_typed(tamper: object) -> None:
    codec = EncryptionCodec(ring("k1")[0])
    [sealed] = await codec.encode([plain_payload()])
    assert callable(tamper)
    bad = Payload(metadata=dict(sealed.metadata), data=tamper(sealed))
    with pytest.raises(DecryptionFailed) as caught:
        await codec.decode([bad])
    assert caught.value.key_id == "k1"


async def test_key_id_is_authenticated_a_payload_relabelled_to_another_key_fails() -> None:
    # Both keys equal: only the associated data (the key id) tells the labels apart.
    key = key_b64()
    codec = EncryptionCodec(KeyRing.parse(f"a:{key},b:{key}", KEYS_ENV))
    [sealed] = await codec.encode([plain_payload()])
    relabelled = Payload(metadata={"encoding": ENCODING, KEY_ID_METADATA: b"b"}, data=sealed.data)
    with pytest.raises(DecryptionFailed):
        await codec.decode([relabelled])


async def test_payloads_written_before_encryption_pass_through() -> None:
    codec = EncryptionCodec(ring("k1")[0])
    assert await codec.decode([plain_payload()]) == [plain_payload()]


async def test_data_converter_encrypts_a_job_request_and_reads_it_back() -> None:
    codec = EncryptionCodec(ring("k1")[0])
    graph = example()
    graph["6"]["inputs"]["text"] = SECRET_MARKER
    request = JobRequest(graph=graph)
    converter = data_converter(codec)
    [payload] = await converter.encode([request])
    assert payload.metadata["encoding"] == ENCODING
    assert SECRET_MARKER.encode() not in payload.SerializeToString()
    [back] = await converter.decode([payload], [JobRequest])
    assert back == request
    assert data_converter(None).payload_codec is None


# -- configuration ------------------------------------------------------------------------------

KEY_MATERIAL = "c2VjcmV0LW1hdGVyaWFsLXRoYXQtbXVzdC1uZXZlci1zaG93"  # 36 bytes: wrong length


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f"k1:{KEY_MATERIAL}", "decodes to 36 bytes"),
        ("k1:not*base64*secret-material", "not standard base64"),
        ("secret-material-without-id", "no ':'"),
        (f"bad id!:{base64.b64encode(b'x' * 32).decode()}", "key id"),
        (
            f"k1:{base64.b64encode(b'x' * 32).decode()},k1:{base64.b64encode(b'y' * 32).decode()}",
            "appears twice",
        ),
        (" , ", "no key entries"),
    ],
    ids=["wrong-length", "not-base64", "no-id", "bad-id", "duplicate-id", "empty"],
)
def test_bad_key_material_is_a_settings_error_that_never_echoes_it(text: str, says: str) -> None:
    with pytest.raises(CodecSettingsError) as caught:
        codec_from_environ({KEYS_ENV: text})
    error = caught.value
    assert says in str(error) and KEYS_ENV in str(error)
    # What a traceback would print: the error and whatever it was raised from or during.
    shown = [error, error.__cause__, None if error.__suppress_context__ else error.__context__]
    for secret in ("secret-material", KEY_MATERIAL, "eHh4"):
        assert all(secret not in repr(e) for e in shown if e is not None)


def test_temporal_settings_stop_at_start_up_on_a_bad_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEYS_ENV, f"k1:{KEY_MATERIAL}")
    with pytest.raises(ValidationError) as caught:
        TemporalSettings()
    assert KEYS_ENV in str(caught.value) and KEY_MATERIAL not in str(caught.value)
    monkeypatch.setenv(KEYS_ENV, new_entry("k1"))
    TemporalSettings()  # a good key passes


def test_keys_file_with_comments_and_lines(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated 2026-11\n{new_entry('new')}\n\n{new_entry('old')}  # until Jan\n")
    codec = codec_from_environ({KEYS_FILE_ENV: str(keys)})
    assert codec is not None and codec.ring.ids == ["new", "old"] and codec.active_id == "new"
    assert "==" not in repr(codec.ring)  # the repr names ids, not keys


def test_keys_file_missing_or_both_set_are_settings_errors(tmp_path: Path) -> None:
    with pytest.raises(CodecSettingsError, match=KEYS_FILE_ENV):
        codec_from_environ({KEYS_FILE_ENV: str(tmp_path / "absent")})
    with pytest.raises(CodecSettingsError, match="not both"):
        codec_from_environ({KEYS_ENV: new_entry("a"), KEYS_FILE_ENV: str(tmp_path)})


def test_no_key_configured_means_no_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEYS_ENV, raising=False)
    monkeypatch.delenv(KEYS_FILE_ENV, raising=False)
    assert codec_from_environ() is None
    assert codec_from_environ({KEYS_ENV: ""}) is None
    assert CodecSettings.from_environ({}).key_ring() is None
