"""Layer-id conventions are converted once, at the edge, into capture indices."""

import pytest
from pydantic import ValidationError

from layertap.errors import SpecError
from layertap.spec import ExtractionSpec, parse_layer_list, resolve_capture


def test_capture_convention_is_identity() -> None:
    spec = resolve_capture([59, 3, 31], convention="capture", num_layers=61, final="post")
    assert spec.layers == (3, 31, 59)
    assert spec.given_ids == (59, 3, 31)
    assert (spec.final_post, spec.final_pre) == (True, False)


def test_sglang_eagle3_ids_are_shifted_by_one() -> None:
    # SGLang 0.5.10 captures the input of layer id+1: draft-config ids [2, 30, 58] = inputs of 3, 31, 59.
    spec = resolve_capture([2, 30, 58], convention="sglang-eagle3", num_layers=61, final="post")
    assert spec.layers == (3, 31, 59)


def test_vllm_final_id_becomes_pre_norm_final() -> None:
    spec = resolve_capture([2, 30, 58, 61], convention="vllm", num_layers=61, final="post")
    assert spec.layers == (2, 30, 58)
    assert spec.final_pre and spec.final_post


@pytest.mark.parametrize(
    ("ids", "convention", "message"),
    [
        ([0], "capture", "outside"),
        ([61], "capture", "outside"),
        ([60], "sglang-eagle3", "outside"),
        ([3, 3], "capture", "duplicate"),
        ([61], "vllm", "no auxiliary layer"),
    ],
)
def test_bad_layer_ids_are_refused(ids, convention, message) -> None:
    with pytest.raises(SpecError, match=message):
        resolve_capture(ids, convention=convention, num_layers=61, final="post")


def test_format_decides_default_final_and_refuses_the_wrong_one(tmp_path) -> None:
    base = {"model": tmp_path, "data": tmp_path / "d.jsonl", "layers": (1, 2)}
    assert ExtractionSpec(**base, format="specforge").final_kind == "post"
    assert ExtractionSpec(**base, format="speculators").final_kind == "pre"
    with pytest.raises(ValidationError, match="pre-norm"):
        ExtractionSpec(**base, format="speculators", final="post")
    with pytest.raises(ValidationError):
        ExtractionSpec(**base, unknown_field=1)


def test_parse_layer_list() -> None:
    assert parse_layer_list("3, 31,59") == [3, 31, 59]
    with pytest.raises(SpecError, match="comma-separated"):
        parse_layer_list("3;31")
