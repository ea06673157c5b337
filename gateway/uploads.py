"""What `POST /v1/uploads` accepts (docs/http-api.md, Uploads): one ComfyUI input file, named,
sized, hashed and typed by the client before it sends a byte.

Every bound is checked here, before anything is signed, and each refusal names its field and
what to send instead; the presigned PUT then holds the client to exactly what it declared
(activities/storage.py, `ArtifactStore.presign_put`).

The accepted files are what ComfyUI's load nodes read: images (LoadImage, LoadImageMask),
video (LoadVideo), audio (LoadAudio), 3D models (Load3D: `.glb`, `.gltf`, `.obj`) and latents
(LoadLatent: `.latent`). Each is accepted by its extension, with the one type the extension
table gives it (`protocol.keys.content_type_for`, what outputs are stored with). That table
gives `application/octet-stream` to `.latent` and to every extension it does not know, so that
type is accepted only on a `.latent` file: taken as a type alone it would let in any file at
all (a `.html` page to be served from the bucket's origin). `.safetensors` is not an input:
model weights are not read from ComfyUI's input folder.
"""

from __future__ import annotations

import json
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import bad_request, invalid, validation_problems
from protocol.keys import content_type_for, extensions_of, safe_component

IMAGE_TYPES: Final = (
    "image/png",
    "image/jpeg",
    "image/webp",
    "image/gif",
    "image/bmp",
    "image/tiff",
)
VIDEO_TYPES: Final = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska")
AUDIO_TYPES: Final = (
    "audio/wav",
    "audio/mpeg",
    "audio/flac",
    "audio/ogg",
    "audio/opus",
    "audio/mp4",
)
MODEL_TYPES: Final = ("model/gltf-binary", "model/gltf+json", "model/obj")
LATENT: Final = ".latent"
# Each accepted extension with the only type a file of that name is accepted as (what the page
# offers too, from GET /v1/config).
UPLOAD_EXTENSIONS: Final = {
    **extensions_of((*IMAGE_TYPES, *VIDEO_TYPES, *AUDIO_TYPES, *MODEL_TYPES)),
    LATENT: content_type_for(LATENT),
}
UPLOAD_TYPES: Final = tuple(dict.fromkeys(UPLOAD_EXTENSIONS.values()))
MAX_FILENAME_CHARS: Final = 255


class UploadRequest(BaseModel):
    """The body of `POST /v1/uploads`: the file the client is about to PUT."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    filename: str = Field(
        min_length=1,
        max_length=MAX_FILENAME_CHARS,
        description="the file's name, without folders (a graph's LoadImage names it)",
        examples=["cat.png"],
    )
    size: int = Field(ge=1, description="its length in bytes")
    sha256: str = Field(
        description="the SHA-256 of its bytes, 64 lowercase hex digits",
        # Shown, not enforced by pydantic: `_hex_digest` refuses with a message that says what
        # to send, where a pattern's would only quote the regex.
        json_schema_extra={"pattern": "^[0-9a-f]{64}$"},
        examples=["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"],
    )
    content_type: str = Field(
        max_length=100,
        description="its type, the one its extension names: one of " + ", ".join(UPLOAD_TYPES),
        examples=["image/png"],
    )

    @field_validator("filename")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the file's name is empty: send its name, such as cat.png")
        if "/" in value or "\\" in value:
            raise ValueError("a file name without folders (no / or \\), such as cat.png")
        if not value.isprintable():
            raise ValueError("a file name without control characters")
        return value

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("64 lowercase hex digits: the SHA-256 of the file's bytes")
        return value

    @property
    def key_name(self) -> str:
        """The file's name as one safe key component (changed names get a digest suffix)."""
        return safe_component(self.filename)


def read_upload(raw: bytes, max_bytes: int) -> UploadRequest:
    """The request, or 400 (not JSON) / 422 naming every field that is wrong and how."""
    if not raw.strip():
        raise invalid([{"loc": [], "message": _BODY_SHAPE}])
    try:
        body: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise invalid([{"loc": [], "message": _BODY_SHAPE}])
    try:
        upload = UploadRequest.model_validate(body)
    except ValidationError as exc:
        raise invalid(validation_problems(exc)) from None
    problems = upload_problems(upload, max_bytes)
    if problems:
        raise invalid(problems)
    return upload


_BODY_SHAPE = 'the body is {"filename", "size", "sha256", "content_type"} as JSON'


def upload_problems(upload: UploadRequest, max_bytes: int) -> list[dict[str, Any]]:
    """The bounds a valid-looking request may still break: its size, its name's extension, its
    type, and the type that extension says it is."""
    problems: list[dict[str, Any]] = []
    if upload.size > max_bytes:
        problems.append(
            {
                "loc": ["size"],
                "message": f"{upload.size:,} bytes; this gateway takes files of at most "
                f"{max_bytes:,} bytes",
            }
        )
    named = UPLOAD_EXTENSIONS.get(extension(upload.filename))
    if named is None:
        problems.append(
            {
                "loc": ["filename"],
                "message": f"{upload.filename!r} is not an input file this gateway takes: name "
                "it with its type's extension (" + ", ".join(UPLOAD_EXTENSIONS) + ")",
            }
        )
    if upload.content_type not in UPLOAD_TYPES:
        problems.append(
            {
                "loc": ["content_type"],
                "message": f"{upload.content_type!r} is not accepted: send one of "
                + ", ".join(UPLOAD_TYPES),
            }
        )
    elif named is not None and named != upload.content_type:
        problems.append(
            {
                "loc": ["content_type"],
                "message": f"{upload.filename!r} is {named} by its extension, not "
                f"{upload.content_type}: send content_type {named!r}, or rename the file",
            }
        )
    return problems


def extension(filename: str) -> str:
    """`.png` of `Cat.PNG`; "" without one (as `protocol.keys.content_type_for` reads it)."""
    dot = filename.rfind(".")
    return filename[dot:].lower() if dot >= 0 else ""
