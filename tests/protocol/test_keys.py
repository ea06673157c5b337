"""Artifact keys: every component sanitised, deterministic, collision-resistant, bounded."""

from __future__ import annotations

import random
import unicodedata

import pytest

from protocol.keys import (
    MAX_COMPONENT_BYTES,
    PLACEHOLDER,
    artifact_key,
    content_type_for,
    safe_component,
)


def _assert_safe_key(key: str) -> None:
    assert not key.startswith("/")
    assert "\\" not in key
    assert ".." not in key
    assert len(key.encode()) <= 1024
    for level in key.split("/"):
        assert level and level not in (".", "..")
        assert not level.startswith(".") and not level.endswith(".")
        assert len(level.encode()) <= MAX_COMPONENT_BYTES
        assert all(unicodedata.category(ch)[0] not in "CZ" for ch in level), repr(level)


def test_plain_names_pass_through_unchanged() -> None:
    key = artifact_key("outputs", "job-1", 0, "9", "ComfyUI_00001_.png")
    assert key == "outputs/job-1/0/9/ComfyUI_00001_.png"


@pytest.mark.parametrize(
    "filename",
    [
        "../../etc/passwd",
        "..\\..\\windows\\win.ini",
        "/etc/passwd",
        "C:\\Users\\x\\a.png",
        "..",
        ".",
        "...",
        ".hidden",
        "a/../../b.png",
        "\uff0e\uff0e\uff0fetc\uff0fpasswd",  # fullwidth "../etc/passwd"
        "%2e%2e/%2e%2e/x",  # percent-encoded "../../x", should anything decode it
        "%2e%2e",
        "a\x00b.png",
        "line\nbreak\r.png",
        "tab\there\x7f.png",
        "\u202egnp.exe",  # right-to-left override
        "zero\u200bwidth.png",
        "bad\udcffsurrogate.png",
        "",
        " ",
        "x" * 10_000 + ".png",
    ],
)
def test_untrusted_filenames_are_neutralised(filename: str) -> None:
    key = artifact_key("outputs", "job-1", 3, "9", filename)
    _assert_safe_key(key)
    assert key.startswith("outputs/job-1/3/9/")
    assert key.count("/") == 4  # subfolders never become extra key levels


def test_subfolders_are_flattened_without_collisions() -> None:
    nested = artifact_key("p", "j", 0, "n", "sub/dir/img.png")
    flat = artifact_key("p", "j", 0, "n", "sub_dir_img.png")
    assert nested.count("/") == 4
    assert nested.rsplit("/", 1)[1].startswith("sub_dir_img-")
    assert nested.endswith(".png")
    assert nested != flat


def test_changed_names_get_distinct_deterministic_digests() -> None:
    a = safe_component("a b.png")
    b = safe_component("a?b.png")
    assert a != b
    assert a == safe_component("a b.png")  # a retry computes the same key
    assert a.startswith("a_b-") and a.endswith(".png")


def test_unicode_letters_survive() -> None:
    assert safe_component("画像_01.png") == "画像_01.png"
    assert safe_component("café.webp") == "café.webp"
    # NFKC folds compatibility forms; still a change, so a digest is added.
    assert safe_component("\uff46\uff55\uff4c\uff4c.png")  # fullwidth "full".startswith("full-")


def test_empty_becomes_a_placeholder() -> None:
    assert safe_component("").startswith(PLACEHOLDER + "-")
    assert artifact_key("", "j", 0, "n", "").split("/")[3].startswith(PLACEHOLDER)
    assert safe_component("") != safe_component("..")


def test_long_components_are_bounded_and_keep_their_extension() -> None:
    a = safe_component("é" * 500 + ".png")
    b = safe_component("é" * 499 + "x.png")
    assert len(a.encode()) <= MAX_COMPONENT_BYTES and a.endswith(".png")
    assert a != b  # truncation alone would have made these equal
    a.encode().decode()  # no split multi-byte character


def test_every_component_is_sanitised() -> None:
    key = artifact_key("../a/./b/", "../job", 2, "12:3/..", "x.png")
    _assert_safe_key(key)
    assert key.split("/")[1:3] == ["a", "b"]  # "." dropped, ".." neutralised, not obeyed
    assert key.count("/") == 6  # three prefix levels, then job, segment, node, filename


def test_segment_must_be_a_non_negative_int() -> None:
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError):
            artifact_key("p", "j", bad, "n", "f")  # type: ignore[arg-type]


def test_overlong_prefix_is_refused() -> None:
    with pytest.raises(ValueError):
        artifact_key("/".join(["p" * 100] * 12), "j", 0, "n", "f")


def test_random_garbage_always_yields_safe_keys() -> None:
    rng = random.Random(42)
    alphabet = "./\\\x00\n\t :?*<>|\"'~\u202e\u200b\uff0e\uff0f\u0301éø漢aZ09_-"
    for _ in range(2000):
        parts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in "pjnf"]
        _assert_safe_key(artifact_key(parts[0], parts[1], rng.randint(0, 99), parts[2], parts[3]))


@pytest.mark.parametrize(
    ("filename", "expected"),
    [
        ("a.png", "image/png"),
        ("A.JPG", "image/jpeg"),
        ("clip.mp4", "video/mp4"),
        ("sound.flac", "audio/flac"),
        ("meta.json", "application/json"),
        ("page.html", "application/octet-stream"),  # never rendered inline from the bucket
        ("icon.svg", "application/octet-stream"),
        ("noext", "application/octet-stream"),
    ],
)
def test_content_type_for(filename: str, expected: str) -> None:
    assert content_type_for(filename) == expected
