"""Object keys for artifacts: `{prefix}/{job_id}/{segment}/{node_id}/{filename}`.

Every component is sanitised because most of them come from outside: output filenames and
subfolders are chosen by the backend (untrusted), the prefix may come from a request, node IDs from
the graph. The rules, applied per component:

- Unicode is NFKC-normalised first, so look-alikes such as FULLWIDTH FULL STOP or FULLWIDTH SOLIDUS
  become the characters they imitate and are then caught by the rules below.
- Only letters, digits, combining marks and ``-_.`` survive; everything else (``/``, ``\\``,
  control and format characters, spaces, S3-awkward punctuation) becomes ``_``.
- No component starts or ends with ``.`` and none contains ``..``: no traversal, no hidden files.
- A component is at most `MAX_COMPONENT_BYTES` of UTF-8, truncated keeping its extension.
- Whenever a value had to be changed, a short digest of the original is appended, so two different
  names never collapse onto one key (one artifact overwriting another would fail its sha256 check
  and leave the job unable to complete). The mapping is deterministic: a retry computes the same
  key, which is what lets it skip artifacts it already uploaded.
- An empty component becomes `PLACEHOLDER` (plus the digest).

`shown` quotes an untrusted name for an error message or a log line.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Collection

MAX_COMPONENT_BYTES = 120
MAX_KEY_BYTES = 1024  # S3's own limit on a key
PLACEHOLDER = "unnamed"

_DIGEST_CHARS = 8
_EXTENSION = re.compile(r"\.[A-Za-z0-9]{1,10}$")
_DOT_RUNS = re.compile(r"\.{2,}")
_PATH_SEPARATORS = re.compile(r"[\\/]+")

# Content types for what ComfyUI nodes write. An explicit table rather than `mimetypes`, whose
# answers depend on the host's /etc/mime.types. Formats a browser would render as active content
# (HTML, SVG, XML, JS) are deliberately absent: served inline from the bucket's origin through a
# presigned URL, an untrusted output would be stored XSS, so they fall back to octet-stream.
_CONTENT_TYPES: dict[str, str] = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
    ".gif": "image/gif",
    ".bmp": "image/bmp",
    ".tif": "image/tiff",
    ".tiff": "image/tiff",
    ".avif": "image/avif",
    ".exr": "image/x-exr",
    ".mp4": "video/mp4",
    ".webm": "video/webm",
    ".mov": "video/quicktime",
    ".mkv": "video/x-matroska",
    ".avi": "video/x-msvideo",
    ".wav": "audio/wav",
    ".mp3": "audio/mpeg",
    ".flac": "audio/flac",
    ".ogg": "audio/ogg",
    ".opus": "audio/opus",
    ".m4a": "audio/mp4",
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
    ".glb": "model/gltf-binary",
    ".gltf": "model/gltf+json",
    ".obj": "model/obj",
    ".ply": "application/octet-stream",
    ".safetensors": "application/octet-stream",
    ".latent": "application/octet-stream",
}
DEFAULT_CONTENT_TYPE = "application/octet-stream"


def safe_component(value: str, *, max_bytes: int = MAX_COMPONENT_BYTES) -> str:
    """Return `value` as one safe key component (no `/`), following the module's rules."""
    return _sanitise(value, original=value, max_bytes=max_bytes)


def artifact_key(prefix: str, job_id: str, segment: int, node_id: str, filename: str) -> str:
    """Build `{prefix}/{job_id}/{segment}/{node_id}/{filename}` with every component sanitised.

    `prefix` may have several levels (`a/b`); each level is sanitised, empty and `.` levels are
    dropped, and an empty prefix is omitted. `filename` may carry a ComfyUI subfolder
    (`sub/dir/name.png`): it is flattened into one component, never into extra key levels.
    """
    if isinstance(segment, bool) or not isinstance(segment, int) or segment < 0:
        raise ValueError(f"segment must be a non-negative int, got {segment!r}")
    parts = [job_folder(prefix, job_id), str(segment), safe_component(node_id)]
    key = "/".join([*parts, _flatten_filename(filename)])
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"artifact key would exceed {MAX_KEY_BYTES} bytes: shorten the prefix")
    return key


def job_folder(prefix: str, job_id: str) -> str:
    """`{prefix}/{job_id}`, sanitised: where everything of one job is stored."""
    # "" and "." prefix levels are no-ops as in a path; ".." is kept, sanitised, so a prefix can
    # never be steered into a sibling.
    levels = [safe_component(level) for level in prefix.split("/") if level not in ("", ".")]
    return "/".join([*levels, safe_component(job_id)])


def content_type_for(filename: str) -> str:
    """The Content-Type to store an artifact with, from its extension only."""
    dot = filename.rfind(".")
    if dot < 0:
        return DEFAULT_CONTENT_TYPE
    return _CONTENT_TYPES.get(filename[dot:].lower(), DEFAULT_CONTENT_TYPE)


def extensions_of(content_types: Collection[str]) -> dict[str, str]:
    """Every extension (`.png`) whose content type is one of `content_types`, with its type:
    the table above, read the other way."""
    return {ext: kind for ext, kind in _CONTENT_TYPES.items() if kind in content_types}


def shown(value: str, limit: int = 80) -> str:
    """An untrusted name as it may appear in a message: ASCII-escaped (no control characters or
    newlines to forge log lines, no look-alike characters), at most `limit` characters of it, in
    a Markdown code span (error messages reach the Temporal UI's details, which render Markdown:
    a name must not become a link)."""
    cut = value[:limit] + ("..." if len(value) > limit else "")
    return "`" + ascii(cut)[1:-1].replace("`", "\\x60") + "`"


def _flatten_filename(filename: str) -> str:
    # Dropping "."/".." levels before joining keeps traversal noise out of the readable part; the
    # digest of the untouched original still tells "a/b.png" and "a_b.png" apart.
    levels = [p for p in _PATH_SEPARATORS.split(filename) if p not in ("", ".", "..")]
    return _sanitise("_".join(levels), original=filename, max_bytes=MAX_COMPONENT_BYTES)


def _sanitise(value: str, *, original: str, max_bytes: int) -> str:
    if max_bytes < 32:
        raise ValueError("max_bytes must leave room for a name and its digest")
    text = unicodedata.normalize("NFKC", value)
    text = "".join(ch if _is_safe_char(ch) else "_" for ch in text)
    text = _DOT_RUNS.sub("_", text).strip(".")
    changed = text != original
    if not text:
        text, changed = PLACEHOLDER, True
    if not changed and len(text.encode()) <= max_bytes:
        return text

    digest = hashlib.sha256(original.encode("utf-8", "surrogatepass")).hexdigest()
    suffix = "-" + digest[:_DIGEST_CHARS]
    match = _EXTENSION.search(text)
    extension = match.group(0) if match and match.start() > 0 else ""
    stem = text[: len(text) - len(extension)]
    room = max_bytes - len(suffix) - len(extension)
    stem = stem.encode()[:room].decode("utf-8", "ignore").rstrip(".") or PLACEHOLDER
    return stem + suffix + extension


def _is_safe_char(ch: str) -> bool:
    if ch in "-_.":
        return True
    if ch.isascii():
        return ch.isalnum()
    category = unicodedata.category(ch)
    return category[0] in "LN" or category in ("Mn", "Mc")


# A run's folder on the backend: `dc_<job>_<segment>_<prompt id's first 8>`
# (`workflows.graph.run_tag`; the job part is `safe_tag`'s: letters, digits, `-`, `_`, at most
# 48 of them). Every literal save prefix of a run is rewritten into its own folder.
RUN_FOLDER = re.compile(r"^dc_[A-Za-z0-9_-]{1,48}_[0-9]+_[A-Za-z0-9-]{1,8}$")


def in_another_run(subfolder: str, run_tag: str) -> bool:
    """Whether an output's subfolder is another run's folder: an output that is not ours (on a
    shared or warm backend, maybe another job's, another tenant's)."""
    top = re.split(r"[\\/]", subfolder, maxsplit=1)[0]
    return top != run_tag and RUN_FOLDER.match(top) is not None
