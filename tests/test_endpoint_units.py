"""The handler's small pieces without any server: its environment, input files, progress updates."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest

from activities.progress import ProgressTracker
from endpoint.contract import MAX_UPDATE_BYTES, ArtifactRecord, InputImage, ProgressUpdate
from endpoint.inputs import InputProblem, decode_image, read_input
from endpoint.reporting import ProgressReporter
from endpoint.settings import EndpointSettings, SettingsError

BUCKET_ENV = {
    "BUCKET_ENDPOINT_URL": "http://127.0.0.1:9000",
    "BUCKET_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "BUCKET_SECRET_ACCESS_KEY": "s3cr3t-value",
}


def test_settings_from_the_workers_environment() -> None:
    bare = EndpointSettings.from_env({})
    assert bare.comfy_url == "http://127.0.0.1:8188" and bare.bucket is None
    assert bare.comfy_pid is None and not bare.refresh_worker

    env = {
        **BUCKET_ENV,
        "BUCKET_NAME": "stock",
        "COMFY_PID": "42",
        "RUNPOD_POD_ID": "pod-7",
        "REFRESH_WORKER": "true",
    }
    settings = EndpointSettings.from_env(env)
    assert settings.comfy_pid == 42 and settings.worker_id == "pod-7" and settings.refresh_worker
    assert settings.bucket is not None and settings.bucket.default_bucket == "stock"
    assert settings.bucket.secret_access_key.get_secret_value() == "s3cr3t-value"
    assert "s3cr3t" not in repr(settings)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"BUCKET_ENDPOINT_URL": "http://s3"}, "BUCKET_ACCESS_KEY_ID"),
        ({"COMFY_PID": "abc"}, "COMFY_PID"),
        ({**BUCKET_ENV, "BUCKET_ADDRESSING_STYLE": "sideways"}, "BUCKET_ADDRESSING_STYLE"),
    ],
)
def test_a_bad_environment_names_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        EndpointSettings.from_env(env)


def test_input_files_in_base64_or_as_data_uris() -> None:
    data = b"\x89PNG-bytes"
    encoded = base64.b64encode(data).decode()
    assert decode_image(0, InputImage(name="a.png", image=encoded)) == data
    uri = InputImage(name="a.png", image=f"data:image/png;base64,{encoded}")
    assert decode_image(0, uri) == data
    wrapped = InputImage(name="a.png", image=encoded[:4] + "\n" + encoded[4:])
    assert decode_image(0, wrapped) == data
    with pytest.raises(InputProblem, match=r"images\[3\] \('b.png'\)"):
        decode_image(3, InputImage(name="b.png", image="not base64!"))
    with pytest.raises(InputProblem, match="data URI must be base64"):
        decode_image(0, InputImage(name="b.png", image="data:text/plain,hello"))


def test_the_workflow_may_come_as_a_json_string_and_so_may_the_input() -> None:
    assert read_input({"workflow": '{"1": {}}'}).workflow == {"1": {}}
    assert read_input('{"workflow": {"1": {}}}').workflow == {"1": {}}
    with pytest.raises(InputProblem, match="must be an object"):
        read_input([1])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reporter(interval_s: float = 1.0) -> tuple[ProgressReporter, list[ProgressUpdate], FakeClock]:
    clock = FakeClock()
    tracker = ProgressTracker({"5": 100}, 7, min_interval_s=interval_s, clock=clock)
    sent: list[ProgressUpdate] = []
    rep = ProgressReporter(
        lambda u: sent.append(ProgressUpdate.model_validate(u)),
        tracker,
        submission="sub-12345678",
        prompt_id="p",
        worker_id="w",
    )
    return rep, sent, clock


def record(n: int) -> ArtifactRecord:
    return ArtifactRecord(
        filename=f"f{n}.png", type="s3_url", data=f"s3://b/{'k' * 200}/{n}", size=1, sha256="0"
    )


def test_progress_is_rate_bounded_except_for_stages_and_artifacts() -> None:
    rep, sent, clock = reporter(interval_s=1.0)
    rep.set_stage("running")
    for step in range(1, 50):  # 49 steps within the same second: none goes out
        rep.tracker.on_progress("5", step)
        rep.moved()
    assert [u.stage for u in sent] == ["running"]
    clock.now = 1.5
    rep.tracker.on_progress("5", 50)
    rep.moved()
    assert sent[-1].step == 50 and sent[-1].total_steps == 100
    rep.set_stage("running")  # no change: nothing sent
    rep.add_artifact(record(1))  # always sent
    rep.set_stage("uploading")
    assert [u.seq for u in sent] == [1, 2, 3, 4]
    assert len(sent[-1].artifacts) == 1 and sent[-1].stage == "uploading"
    assert all(u.at.utcoffset() == timedelta(0) for u in sent)
    assert sent[-1].at <= datetime.now(UTC)


def test_an_update_stays_under_the_sdks_size_limit() -> None:
    rep, sent, _ = reporter()
    for n in range(3000):
        rep.artifacts.append(record(n))
    rep.add_artifact(record(3000))
    last = sent[-1]
    assert len(last.model_dump_json()) <= MAX_UPDATE_BYTES
    assert last.artifacts[-1].filename == "f3000.png"  # the newest are kept
    assert last.artifacts_omitted == 3001 - len(last.artifacts) > 0
