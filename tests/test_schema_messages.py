"""Length bounds of free text are worded as a string's in a 422's errors, whatever the type."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from api_schemas.tasks import PolicyIn, ReleaseIn, Shard

POLICY = {"step": 1, "sha256": "a" * 64, "size": 1}
SHARD = {"sha256": "a" * 64, "bytes": 1}


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        (ReleaseIn, {"error": ""}, "String should have at least 1 character"),
        (ReleaseIn, {"error": "x" * 1001}, "String should have at most 1000 characters"),
        (PolicyIn, {**POLICY, "uri": ""}, "String should have at least 1 character"),
        (PolicyIn, {**POLICY, "uri": "s3://" + "x" * 2048}, "String should have at most 2048 characters"),
        (Shard, {**SHARD, "uri": ""}, "String should have at least 1 character"),
        # The bounds moved before the validators; those still run.
        (ReleaseIn, {"error": "a\x00"}, "must not contain a NUL character"),
        (PolicyIn, {**POLICY, "uri": "s3://a\x00"}, "must not contain a NUL character"),
        (PolicyIn, {**POLICY, "uri": " s3://a"}, "must not begin or end with whitespace"),
    ],
)
def test_text_bounds_are_worded_as_a_strings(
    model: type[BaseModel], body: dict[str, Any], message: str
) -> None:
    """`Annotated[Text, Field(min_length=...)]` checked the bounds after Text's validator, as a
    generic sequence's: a release with `{"error": ""}` was refused with "Value should have at
    least 1 item after validation, not 0"."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    [error] = caught.value.errors()
    assert message in error["msg"], error
    assert "item" not in error["msg"], error
