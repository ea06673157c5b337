"""The handler's removal of a run's files from ComfyUI's folders (endpoint/job_files.py), on
plain folders in tmp_path: what goes, what stays, and that no name, however hostile, reaches
outside the folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from endpoint.errors import UnsafePath
from endpoint.job_files import JobFiles, inside, located
from endpoint.settings import ComfyFolders, EndpointSettings
from tests.stack.test_hostile_backends import HOSTILE_FILENAMES, HOSTILE_SUBFOLDERS

RUN = "dc_job-7_0_7d7c6a1e"


@pytest.fixture
def folders(tmp_path: Path) -> ComfyFolders:
    """ComfyUI's three folders, as ComfyUI creates them when it starts."""
    comfy = tmp_path / "comfyui"
    made = ComfyFolders(input=comfy / "input", output=comfy / "output", temp=comfy / "temp")
    for folder in (made.input, made.output, made.temp):
        folder.mkdir(parents=True)
    return made


def write(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def image(filename: str, subfolder: str = RUN, kind: str = "output") -> dict[str, str]:
    return {"filename": filename, "subfolder": subfolder, "type": kind}


# --- the paths ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["a.png", "sub/a.png", f"{RUN}/deeper/a.png", "./a.png", "a b (1).png", "..a.png"]
)
def test_a_name_inside_the_folder_resolves_there(tmp_path: Path, name: str) -> None:
    path = inside(tmp_path, name)
    assert path.is_relative_to(tmp_path.resolve()) and path != tmp_path.resolve()


@pytest.mark.parametrize(
    "name",
    [
        "",
        "..",
        "../x",
        "../../etc/passwd",
        "sub/../../x",
        "/etc/passwd",
        "\\x",
        "C:x",
        "a\x00b.png",
        ".",
        "sub/..",
    ],
)
def test_a_name_that_climbs_or_is_absolute_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafePath):
        inside(tmp_path / "folder", name)


def test_a_symlink_out_of_the_folder_is_refused_and_its_target_kept(tmp_path: Path) -> None:
    folder, outside = tmp_path / "output", tmp_path / "elsewhere"
    secret = write(outside / "secret.txt")
    folder.mkdir()
    (folder / "to-elsewhere").symlink_to(outside, target_is_directory=True)
    (folder / "evil.png").symlink_to(secret)
    for name in ("to-elsewhere/secret.txt", "evil.png"):
        with pytest.raises(UnsafePath):
            inside(folder, name)
    # A link that stays inside is a file of the folder: the link goes, never what it names.
    (folder / "alias.png").symlink_to(folder / "real.png")
    assert inside(folder, "alias.png") == folder.resolve() / "alias.png"


# --- what a run's clear-up removes ----------------------------------------------------------


async def test_inputs_previews_stored_outputs_and_the_emptied_run_folder_go(
    folders: ComfyFolders,
) -> None:
    uploaded = write(folders.input / "photo.png")
    renamed = write(folders.input / "sub" / "mask.png")
    preview = write(folders.temp / "ComfyUI_temp_abcde_00001_.png")
    saved = [write(folders.output / RUN / f"img_0000{n}_.png") for n in (1, 2)]
    deep = write(folders.output / RUN / "b" / "c" / "img_00001_.png")
    # What is not the run's: an earlier job's files, and files of the image.
    others = [
        write(folders.input / "example.png"),
        write(folders.output / "dc_job-6_0_0a1b2c3d" / "img_00001_.png"),
        write(folders.output / "_output_images_will_be_put_here"),
    ]

    files = JobFiles(folders)
    files.uploading("photo.png")
    files.uploaded("photo.png")
    files.uploading("mask.png")
    files.uploaded("sub/mask.png")  # where ComfyUI said it stored it
    files.list_outputs(
        {
            "9": {"images": [image(p.name) for p in saved]},
            "10": {"images": [image("img_00001_.png", f"{RUN}/b/c")]},
            "11": {"images": [image(preview.name, "", "temp")]},
            # Never removed: `input` is not an output folder.
            "12": {"images": [image("example.png", "", "input")]},
        }
    )
    for path in [*saved, deep]:
        files.mark_stored(str(path.parent.relative_to(folders.output)), path.name)

    with capture_logs() as logs:
        await files.clear(stored_outputs=True)

    for gone in (uploaded, renamed, preview, *saved, deep):
        assert not gone.exists(), gone
    assert not (folders.output / RUN).exists(), "the emptied run folder goes, its subfolders too"
    assert not (folders.input / "sub").exists()
    assert all(other.exists() for other in others)
    assert folders.input.is_dir() and folders.output.is_dir() and folders.temp.is_dir()
    [removed] = [e for e in logs if e["event"] == "comfy_files_removed"]
    assert removed["removed"] == 6 and removed["refused"] == removed["failed"] == 0
    assert not [e for e in logs if e["event"] == "comfy_outputs_kept"]


async def test_an_output_not_stored_stays_with_its_folder(folders: ComfyFolders) -> None:
    stored = write(folders.output / RUN / "img_00001_.png")
    unstored = write(folders.output / RUN / "img_00002_.png")
    files = JobFiles(folders)
    files.list_outputs({"9": {"images": [image(stored.name), image(unstored.name)]}})
    files.mark_stored(RUN, stored.name)

    with capture_logs() as logs:
        await files.clear(stored_outputs=True)

    assert not stored.exists() and unstored.exists()
    [kept] = [e for e in logs if e["event"] == "comfy_outputs_kept"]
    assert kept["outputs"] == 1 and kept["stored"] == 0


async def test_until_the_outcome_is_recorded_every_output_stays(folders: ComfyFolders) -> None:
    """A later delivery may re-attach to the prompt and store every output again from the
    folder: inputs and previews go, outputs stay, stored or not, until a clear that may."""
    uploaded = write(folders.input / "photo.png")
    preview = write(folders.temp / "p.png")
    stored = write(folders.output / RUN / "img_00001_.png")
    files = JobFiles(folders)
    files.uploading("photo.png")
    files.list_outputs({"9": {"images": [image(stored.name), image("p.png", "", "temp")]}})
    files.mark_stored(RUN, stored.name)

    await files.clear(stored_outputs=False)
    assert not uploaded.exists() and not preview.exists() and stored.exists()

    await files.clear(stored_outputs=True)
    assert not stored.exists() and not (folders.output / RUN).exists()


async def test_a_file_already_gone_is_fine_and_one_that_cannot_go_is_logged(
    folders: ComfyFolders,
) -> None:
    # A name that is a folder cannot be unlinked: logged, and the job goes on.
    stuck = folders.output / RUN / "img_00002_.png"
    stuck.mkdir(parents=True)
    files = JobFiles(folders)
    files.uploading("never-written.png")
    files.list_outputs({"9": {"images": [image("img_00001_.png"), image(stuck.name)]}})
    files.mark_stored(RUN, "img_00001_.png")
    files.mark_stored(RUN, stuck.name)

    with capture_logs() as logs:
        await files.clear(stored_outputs=True)  # raises nothing

    assert stuck.is_dir()
    [removed] = [e for e in logs if e["event"] == "comfy_files_removed"]
    assert removed["removed"] == 0 and removed["failed"] == 1
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["comfy_file_not_removed"]


async def test_hostile_names_remove_nothing_outside_the_folders(
    folders: ComfyFolders, tmp_path: Path
) -> None:
    """Names from a job's input and from ComfyUI's history are untrusted: whatever they say,
    nothing outside the three folders is touched."""
    # Files a climbing name could reach: beside the folders, and above them.
    targets = [
        write(tmp_path / "x"),
        write(tmp_path / "comfyui" / "x"),
        write(tmp_path / "comfyui" / "a.png"),
        write(tmp_path / "comfyui" / "main.py"),
    ]
    before = files_under(tmp_path)
    files = JobFiles(folders)
    for name in ("../x", "../../x", "../main.py", "/etc/passwd", str(tmp_path / "x")):
        files.uploading(name)
    hostile = [
        *(image(name) for name in HOSTILE_FILENAMES.values()),
        *(image("a.png", sub) for sub in HOSTILE_SUBFOLDERS.values()),
        *(image(name, "", "temp") for name in HOSTILE_FILENAMES.values()),
        image("a.png", "..", "temp"),
        image("x", "../..", "output"),
    ]
    files.list_outputs({"9": {"images": hostile}})
    for item in hostile:
        files.mark_stored(item["subfolder"], item["filename"])

    with capture_logs() as logs:
        await files.clear(stored_outputs=True)

    assert files_under(tmp_path) == before
    assert all(target.exists() for target in targets)
    [removed] = [e for e in logs if e["event"] == "comfy_files_removed"]
    assert removed["removed"] == 0 and removed["refused"] >= 10, removed
    refusals = [e for e in logs if e["event"] == "comfy_file_refused"]
    assert all(e["log_level"] == "warning" and e["name"].isascii() for e in refusals)


async def test_unknown_folders_are_said_once_and_nothing_is_removed(tmp_path: Path) -> None:
    missing = ComfyFolders(
        input=tmp_path / "nowhere" / "input",
        output=tmp_path / "nowhere" / "output",
        temp=tmp_path / "nowhere" / "temp",
    )
    files = JobFiles(missing)
    files.uploading("photo.png")
    with capture_logs() as logs:
        await files.locate()
        await files.locate()
        await JobFiles(missing).locate()
        await files.clear(stored_outputs=True)
    [warning] = [e for e in logs if e["event"] == "comfy_folders_unknown"]
    assert warning["log_level"] == "warning"
    assert set(warning["missing"]) == {"input", "output", "temp"}
    assert "COMFY_DIR" in warning["fix"] and "COMFY_TEMP_DIR" in warning["fix"]
    assert located(missing) == {}


async def test_a_missing_temp_folder_leaves_the_others_cleared(folders: ComfyFolders) -> None:
    os.rmdir(folders.temp)
    uploaded = write(folders.input / "photo.png")
    files = JobFiles(folders)
    files.uploading("photo.png")
    with capture_logs() as logs:
        await files.clear(stored_outputs=True)
    assert not uploaded.exists()
    [warning] = [e for e in logs if e["event"] == "comfy_folders_unknown"]
    assert list(warning["missing"]) == ["temp"]


# --- where the folders are ------------------------------------------------------------------


def test_comfyuis_folders_come_from_the_environment() -> None:
    assert EndpointSettings.from_env({}).comfy_folders == ComfyFolders(
        input=Path("/comfyui/input"), output=Path("/comfyui/output"), temp=Path("/comfyui/temp")
    )
    assert EndpointSettings.from_env({"COMFY_DIR": "/opt/ComfyUI"}).comfy_folders == ComfyFolders(
        input=Path("/opt/ComfyUI/input"),
        output=Path("/opt/ComfyUI/output"),
        temp=Path("/opt/ComfyUI/temp"),
    )
    moved = EndpointSettings.from_env(
        {
            "COMFY_DIR": "/opt/ComfyUI",
            "COMFY_INPUT_DIR": "/vol/in",
            "COMFY_OUTPUT_DIR": "/vol/out",
            # As given to --temp-directory: ComfyUI keeps its previews in `temp` inside it.
            "COMFY_TEMP_DIR": "/scratch",
        }
    )
    assert moved.comfy_folders == ComfyFolders(
        input=Path("/vol/in"), output=Path("/vol/out"), temp=Path("/scratch/temp")
    )
