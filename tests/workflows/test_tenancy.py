"""The storage rules of workflows/tenancy.py, and the worker's use of them in prepare."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError

from activities.inputs import refuse_inputs_outside_area
from configuration.settings import S3Settings
from gateway.errors import ApiError
from gateway.submission import job_request
from workflows.activity_io import PrepareInput
from workflows.contracts import OutputSpec, S3Input
from workflows.errors import InputOutsideArea, OutputOutsideArea, StorageConfigError
from workflows.shared import ErrorType
from workflows.tenancy import check_input_uri, check_output, normalised_allowed_prefix

GRAPH = {"1": {"class_type": "LoadImage", "inputs": {"image": "in.png"}}}
ALLOWED = ("s3://assets/shared/",)


def allowed(uri: str, tenant: str = "acme") -> bool:
    try:
        check_input_uri("in.png", uri, tenant=tenant, bucket="art", allowed=ALLOWED)
    except InputOutsideArea:
        return False
    return True


@pytest.mark.parametrize(
    "uri",
    [
        "s3://art/jobs/acme/acme.1/0/9/ComfyUI_00001_.png",
        "s3://art/jobs/acme/project/acme.2/0/9/x.png",
        "s3://art/_staged/acme/" + "a" * 64 + "/cat.png",
        "s3://assets/shared/masks/round.png",
    ],
)
def test_a_tenant_may_read_its_own_area_and_the_allowed_folders(uri: str) -> None:
    assert allowed(uri)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://art/jobs/beta/beta.1/0/9/ComfyUI_00001_.png",  # another tenant's result
        "s3://art/_staged/beta/x/cat.png",  # another tenant's upload
        "s3://art/jobs/acme-evil/x.png",  # a tenant whose name starts like ours
        "s3://art/jobs/acme",  # the area itself is no object
        "s3://art/jobs/acme/../beta/x.png",  # a store that maps keys to paths
        "s3://art/jobs/acme//x.png",
        "s3://art/jobs/acme/./x.png",
        "s3://art/jobs/acme\\..\\beta\\x.png",
        "s3://other/jobs/acme/x.png",  # the area of another bucket
        "s3://assets/shared-secrets/x.png",  # beside an allowed folder
        "s3://art/_durable_comfy/endpoints/e/object_info.json",  # the service's own files
    ],
)
def test_anything_else_is_refused_naming_the_input_and_the_rule(uri: str) -> None:
    assert not allowed(uri)


def test_the_refusal_says_what_to_do_instead() -> None:
    with pytest.raises(InputOutsideArea) as refused:
        check_input_uri("in.png", "s3://art/jobs/beta/x.png", tenant="acme", bucket="art")
    message = str(refused.value)
    assert "input 'in.png'" in message and "outside tenant 'acme'" in message
    assert "s3://art/jobs/acme/" in message and "POST /v1/uploads" in message


def test_allowed_prefixes_are_folders() -> None:
    assert normalised_allowed_prefix("s3://assets/shared") == "s3://assets/shared/"
    assert normalised_allowed_prefix("s3://assets/shared/") == "s3://assets/shared/"
    assert normalised_allowed_prefix("s3://assets") == "s3://assets/"
    for bad in ("assets/shared", "https://assets/x", "s3:///x", "s3://a/b/../c"):
        with pytest.raises(ValueError):
            normalised_allowed_prefix(bad)


def test_the_worker_reads_the_allowed_prefixes_from_its_variable() -> None:
    settings = S3Settings.from_env(
        {
            "DURABLE_COMFY_BUCKET": "art",
            "DURABLE_COMFY_ALLOWED_INPUT_PREFIXES": "s3://assets/shared, s3://models",
        }
    )
    assert settings.allowed_input_prefixes == ("s3://assets/shared/", "s3://models/")
    with pytest.raises(StorageConfigError, match="DURABLE_COMFY_ALLOWED_INPUT_PREFIXES"):
        S3Settings.from_env(
            {"DURABLE_COMFY_BUCKET": "art", "DURABLE_COMFY_ALLOWED_INPUT_PREFIXES": "x"}
        )


@pytest.mark.parametrize(
    ("prefix", "bucket", "field"),
    [
        ("jobs/beta", None, "prefix"),
        ("jobs", None, "prefix"),
        ("", None, "prefix"),
        ("jobs/acme/../beta", None, "prefix"),
        ("jobs/acme-x", None, "prefix"),
        ("jobs/acme", "elsewhere", "bucket"),
    ],
)
def test_an_output_outside_the_area_is_refused(prefix: str, bucket: str | None, field: str) -> None:
    with pytest.raises(OutputOutsideArea) as refused:
        check_output("acme", prefix, bucket, "art")
    assert refused.value.field == field


@pytest.mark.parametrize("prefix", ["jobs/acme", "jobs/acme/", "/jobs/./acme/project/2026"])
def test_an_output_in_the_area_is_accepted(prefix: str) -> None:
    check_output("acme", prefix, None, "art")
    check_output("acme", prefix, "art", "art")


def prepare(uri: str, tenant: str | None) -> PrepareInput:
    return PrepareInput(
        job_id="j",
        pool=None,
        graph=GRAPH,
        inputs={"in.png": S3Input(uri=uri)},
        tenant=tenant,
    )


STORAGE = S3Settings.from_env({}, bucket="art", allowed_input_prefixes=ALLOWED)


def test_prepare_refuses_a_tenants_input_outside_its_area_for_good() -> None:
    with pytest.raises(ApplicationError) as refused:
        refuse_inputs_outside_area(prepare("s3://art/jobs/beta/x.png", "acme"), STORAGE)
    assert refused.value.type == ErrorType.INVALID_REQUEST and refused.value.non_retryable
    assert "in.png" in str(refused.value)


def test_prepare_checks_against_the_jobs_own_bucket() -> None:
    req = prepare("s3://mine/jobs/acme/x.png", "acme")
    with pytest.raises(ApplicationError):
        refuse_inputs_outside_area(req, STORAGE)
    refuse_inputs_outside_area(
        req.model_copy(update={"output": OutputSpec(bucket="mine")}), STORAGE
    )


def test_prepare_leaves_a_job_of_no_tenant_alone() -> None:
    refuse_inputs_outside_area(prepare("s3://anything/at/all.png", None), STORAGE)
    refuse_inputs_outside_area(prepare("s3://assets/shared/a.png", "acme"), STORAGE)


INLINE = {"kind": "inline", "filename": "in.png", "data_b64": ""}


def body(**extra: object) -> dict[str, object]:
    return {"graph": GRAPH, "inputs": {"in.png": INLINE}, **extra}


def test_the_gateway_stores_a_tenants_jobs_in_its_area_unless_told_a_folder_of_it() -> None:
    request, _ = job_request(body(), "acme", STORAGE)
    assert request.output.prefix == "jobs/acme" and request.labels["tenant"] == "acme"
    request, _ = job_request(body(output={"presign_ttl_s": 60}), "acme", STORAGE)
    assert request.output.prefix == "jobs/acme" and request.output.presign_ttl_s == 60
    request, _ = job_request(body(output={"prefix": "jobs/acme/p"}), "acme", STORAGE)
    assert request.output.prefix == "jobs/acme/p"
    with pytest.raises(ApiError):
        job_request(body(output={"prefix": "jobs/beta"}), "acme", STORAGE)


def test_the_gateway_without_a_bucket_takes_no_output_bucket() -> None:
    with pytest.raises(ApiError):
        job_request(body(output={"bucket": "art"}), "acme", None)
    request, _ = job_request(body(output={"bucket": "art"}), "acme", STORAGE)
    assert request.output.bucket == "art"
