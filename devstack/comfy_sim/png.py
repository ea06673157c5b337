"""Deterministic, valid PNG and animated WebP files without Pillow: zlib + struct only.

Pixels are cheap patterns (8-pixel bands of two alternating colours) so a 512x512 PNG encodes in a
few milliseconds; a solid image stays solid (EmptyImage's colour survives to the saved file).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

from .values import RGB, SimImage, mix

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _colour(seed: int, salt: int) -> RGB:
    value = mix(seed, salt)
    return (value & 0xFF, (value >> 8) & 0xFF, (value >> 16) & 0xFF)


def frame_colour(image: SimImage) -> RGB:
    """The one colour that stands for an image where a format cannot carry the pattern cheaply."""
    return image.solid if image.solid is not None else _colour(image.fingerprint, 0)


def _rows(image: SimImage) -> Iterable[bytes]:
    """Filter byte 0 + RGB bytes for every row; each band's row is built once and reused."""
    width, height = image.width, image.height
    if image.solid is not None:
        row = b"\x00" + bytes(image.solid) * width
        for _ in range(height):
            yield row
        return
    for band in range(0, height, 8):
        a, b = _colour(image.fingerprint, band), _colour(image.fingerprint, -band - 1)
        block = bytes(a) * 16 + bytes(b) * 16
        row = b"\x00" + (block * (width // 32 + 1))[: width * 3]
        for _ in range(min(8, height - band)):
            yield row


def _text_chunk(key: str, value: str) -> bytes:
    try:
        return _chunk(b"tEXt", key.encode("latin-1") + b"\x00" + value.encode("latin-1"))
    except UnicodeEncodeError:
        # Pillow's PngInfo falls back to iTXt (UTF-8) for text latin-1 cannot carry.
        header = key.encode("latin-1") + b"\x00\x00\x00\x00\x00"
        return _chunk(b"iTXt", header + value.encode("utf-8"))


def encode_png(image: SimImage, text: dict[str, str] | None = None, level: int = 1) -> bytes:
    """An 8-bit RGB PNG of `image` (one frame), with optional tEXt metadata like SaveImage's."""
    ihdr = struct.pack(">IIBBBBB", image.width, image.height, 8, 2, 0, 0, 0)
    parts = [PNG_SIGNATURE, _chunk(b"IHDR", ihdr)]
    for key, value in (text or {}).items():
        parts.append(_text_chunk(key, value))
    parts.append(_chunk(b"IDAT", zlib.compress(b"".join(_rows(image)), level)))
    parts.append(_chunk(b"IEND", b""))
    return b"".join(parts)


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR, or None when `data` is not a PNG."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


class _BitWriter:
    """LSB-first bit packing, as WebP lossless (VP8L) streams are written."""

    def __init__(self) -> None:
        self.value = 0
        self.bits = 0

    def put(self, value: int, nbits: int) -> None:
        self.value |= (value & ((1 << nbits) - 1)) << self.bits
        self.bits += nbits

    def data(self) -> bytes:
        return self.value.to_bytes((self.bits + 7) // 8, "little")


def _vp8l_solid(width: int, height: int, rgb: RGB) -> bytes:
    """A VP8L bitstream for a solid image: five single-symbol prefix codes, so each pixel costs
    zero bits and any size encodes in a few bytes."""
    w = _BitWriter()
    w.put(0x2F, 8)  # VP8L signature
    w.put(width - 1, 14)
    w.put(height - 1, 14)
    w.put(0, 1)  # alpha_is_used
    w.put(0, 3)  # version
    w.put(0, 1)  # no transform
    w.put(0, 1)  # no colour cache
    w.put(0, 1)  # no meta prefix codes
    for symbol in (rgb[1], rgb[0], rgb[2], 255):  # green, red, blue, alpha literals
        w.put(1, 1)  # simple code
        w.put(0, 1)  # one symbol
        w.put(1, 1)  # 8-bit symbol
        w.put(symbol, 8)
    w.put(1, 1)  # distance code: simple, one symbol, 1-bit symbol 0
    w.put(0, 1)
    w.put(0, 1)
    w.put(0, 1)
    return w.data()


def _riff_chunk(kind: bytes, data: bytes) -> bytes:
    pad = b"\x00" if len(data) % 2 else b""
    return kind + struct.pack("<I", len(data)) + data + pad


def _u24(value: int) -> bytes:
    return struct.pack("<I", value)[:3]


def encode_animated_webp(frames: list[SimImage], fps: float) -> bytes:
    """An animated WebP (VP8X + ANIM + one ANMF per frame); each frame is a solid colour."""
    width, height = frames[0].width, frames[0].height
    duration = max(1, round(1000 / fps)) if fps > 0 else 100
    body = [_riff_chunk(b"VP8X", bytes([0x02, 0, 0, 0]) + _u24(width - 1) + _u24(height - 1))]
    body.append(_riff_chunk(b"ANIM", b"\x00\x00\x00\x00" + struct.pack("<H", 0)))
    for frame in frames:
        bitstream = _riff_chunk(b"VP8L", _vp8l_solid(width, height, frame_colour(frame)))
        header = _u24(0) + _u24(0) + _u24(width - 1) + _u24(height - 1) + _u24(duration)
        body.append(_riff_chunk(b"ANMF", header + b"\x02" + bitstream))
    payload = b"WEBP" + b"".join(body)
    return b"RIFF" + struct.pack("<I", len(payload)) + payload
