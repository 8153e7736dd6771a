"""Shapes shared by every domain: problems, pages, key ids."""

from __future__ import annotations

import datetime as dt
import math
import types
from typing import Annotated, Any, Generic, TypeVar, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    AllowInfNan,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    FailFast,
    Field,
    GetJsonSchemaHandler,
    PlainValidator,
    Strict,
    WrapValidator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from orchestrator.core.keys import is_key_id

T = TypeVar("T")


def _check_key_id(value: str) -> str:
    if not is_key_id(value):
        raise ValueError("must be a raw 32-byte Ed25519 public key in unpadded base64url (43 characters)")
    return value


NO_NUL = r"^[^\x00]*$"
"""The same rule as a pattern, for path and query parameters (Path(pattern=...), Query(...))."""


def is_unicode(text: str) -> bool:
    """Whether ``text`` is Unicode characters only: no lone surrogate, which UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain a NUL character (U+0000)")
    # A string with bounds or a pattern is refused by pydantic's core when it holds a lone
    # surrogate (JSON's \ud800); one without (a heartbeat's lease ids) reached the database,
    # which cannot encode it as UTF-8 (a 500).
    if not is_unicode(value):
        raise ValueError("must be Unicode text (no lone surrogate)")
    return value


class _NoNul(AfterValidator):
    """The validator, said in the OpenAPI document too: a ``pattern`` without NUL, unless the
    field has a pattern of its own."""

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        schema.setdefault("pattern", NO_NUL)
        return schema


NoNul = _NoNul(_check_no_nul)

Text = Annotated[str, NoNul]
"""Free text that is stored or compared in SQL: PostgreSQL text cannot hold a NUL, so one is
refused as bad input (422 in a body) instead of failing in the database (500). Give its length
bounds on the field (``name: Text = Field(max_length=...)``); a type with bounds of its own is
``Annotated[str, Field(...), NoNul]``: bounds after the validator are checked as a generic
sequence's ("Value should have at least 1 item after validation")."""


def _utc_representable(value: dt.datetime) -> dt.datetime:
    try:
        value.astimezone(dt.UTC)
    except OverflowError:
        raise ValueError("must be a time whose UTC date is in the years 1 to 9999") from None
    return value


UtcTime = Annotated[AwareDatetime, AfterValidator(_utc_representable)]
"""A time with a UTC offset, for a body: its UTC time must exist too (9999-12-31T23:59:59-12:00
is in the year 10000 in UTC, which no time can hold: comparing or storing it failed, 500)."""


# The canonical unpadded base64url of 32 bytes: its last character carries 2 unused bits, which
# are 0. Documented only: _check_key_id decides, with its own message.
KEY_ID_PATTERN = r"^[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]$"

KeyId = Annotated[
    str,
    Field(
        min_length=43,
        max_length=43,
        examples=["Q2FsbWx5IGFuZCBjYXJlZnVsbHkgc2lnbmVkIGtleSE"],
        json_schema_extra={"pattern": KEY_ID_PATTERN},
    ),
    AfterValidator(_check_key_id),
]


# The deepest nesting of objects and arrays a JsonObject may have (the object itself is level 1).
MAX_JSON_DEPTH = 64


def _finite_json(value: dict[str, Any]) -> dict[str, Any]:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError("NaN and Infinity are not JSON numbers")
        if isinstance(item, str) and not is_unicode(item):
            raise ValueError("strings must be Unicode text (no lone surrogate)")
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"objects and arrays may be nested at most {MAX_JSON_DEPTH} deep")
            if isinstance(item, dict) and not all(is_unicode(key) for key in item):
                raise ValueError("names must be Unicode text (no lone surrogate)")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return value


# A JSON object kept in a JSON column: Python's JSON parser accepts the bare words NaN and
# Infinity, which PostgreSQL's json type refuses (a 500) and SQLite's would serve back as null,
# and a lone surrogate (\ud800) in a string or a name, which UTF-8 cannot encode (the enqueue's
# batch digest failed with a 500, and a stored one reached workers as bytes that are not UTF-8).
# Nesting is bounded: pydantic serializes at most some 255 levels, so a task's metadata 300 deep
# failed the enqueue with a 500, and one a little less deep could be stored and then fail every
# answer that wraps it in more levels (a validator's job carries the verification spec).
JsonObject = Annotated[dict[str, Any], AfterValidator(_finite_json)]

# Numbers inside lists and maps of a request body (token ids, heartbeat metrics, logprob
# summaries): pydantic's strict mode, checked in its core rather than by a Python call per item,
# refuses true and strings as StrictModel does for number fields. A strict integer also refuses a
# float written with a fraction part of zero (3.0).
JsonInt = Annotated[int, Strict()]
JsonFloat = Annotated[float, Strict()]
# The same, finite: Python's parser reads the bare words NaN and Infinity, which are not JSON.
FiniteJsonFloat = Annotated[float, Strict(), AllowInfNan(False)]


def _is_of(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field's type is one of ``kinds`` (possibly optional or annotated; bool is not
    int here)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return bool(members) and all(_is_of(a, kinds) for a in members)
    return annotation in kinds


def _is_number(annotation: Any) -> bool:
    return _is_of(annotation, (int, float))


def _json_number(value: Any) -> Any:
    if isinstance(value, bool | str):
        kind = "true or false" if isinstance(value, bool) else "a string"
        raise ValueError(f"must be a JSON number, not {kind}")
    return value


_JSON_NUMBER = BeforeValidator(_json_number)


def _json_bool(value: Any) -> Any:
    if value is not None and not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


_JSON_BOOL = BeforeValidator(_json_bool)


def _is_collection(annotation: Any) -> bool:
    """Whether a field's type is a plain list or dict, possibly optional (an annotated one, such
    as ``JsonObject``, carries validators of its own, which the constraint cannot wrap)."""
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_collection(a) for a in get_args(annotation) if a is not type(None))
    return get_origin(annotation) in (list, dict) or annotation in (list, dict)


# A list or dict field stops at its first item that does not validate, and an object with more
# unknown fields than this is refused as one error: a body of a few MiB otherwise made pydantic
# report an error per item or field (a million "x" token ids, a million unknown keys), and
# building and sending those (hundreds of MB) blocked the event loop for seconds.
_FAIL_FAST = FailFast()
# A field whose type carries validators of its own (JsonObject) is left as it is: the constraint
# cannot wrap them, and such a dict's items (Any) cannot fail one by one anyway.
_VALIDATORS = (AfterValidator, BeforeValidator, PlainValidator, WrapValidator)
MAX_UNKNOWN_FIELDS = 10


class StrictModel(BaseModel):
    """Request bodies: unknown fields are refused, so typos do not pass silently; a number field
    takes a JSON number only (pydantic alone reads true as 1 and "5" as 5), and a boolean field
    true or false only (pydantic alone reads "yes", "on", 1 and 0.0 as booleans: "canary": "yes"
    made a canary task). The checks are given to those fields alone, once, when each body model
    is defined: validating a body runs them for those fields only.

    The errors of a body are bounded, whatever its size: a list or dict field reports its first
    item that does not validate, not every one (``FailFast``, given to those fields the same
    way), and more than ``MAX_UNKNOWN_FIELDS`` unknown fields are one error."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > len(cls.model_fields) + MAX_UNKNOWN_FIELDS:
            unknown = [key for key in data if key not in cls.model_fields]
            if len(unknown) > MAX_UNKNOWN_FIELDS:
                named = ", ".join(repr(str(key)[:40]) for key in unknown[:3])
                raise ValueError(f"{len(unknown)} unknown fields ({named}, ...); none is allowed")
        return data

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        changed = False
        for field in cls.model_fields.values():
            if _is_number(field.annotation) and _JSON_NUMBER not in field.metadata:
                field.metadata.append(_JSON_NUMBER)
                changed = True
            if _is_of(field.annotation, (bool,)) and _JSON_BOOL not in field.metadata:
                field.metadata.append(_JSON_BOOL)
                changed = True
            if (
                _is_collection(field.annotation)
                and _FAIL_FAST not in field.metadata
                and not any(isinstance(m, _VALIDATORS) for m in field.metadata)
            ):
                field.metadata.append(_FAIL_FAST)
                changed = True
        if changed:
            cls.model_rebuild(force=True)


class Problem(BaseModel):
    """RFC 9457 problem details, with a stable machine-readable ``code``."""

    type: str = Field(
        description="URI reference naming the problem type: /problems/{code}, which GET /problems/{code} "
        "serves as the code's documentation"
    )
    title: str
    status: int
    detail: str
    code: str = Field(description="Stable machine code, e.g. signature_invalid, nonce_replayed")
    instance: str | None = None
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="Validation errors, for 422 and 400 invalid_query / invalid_header"
    )
    provider_retired: bool | None = Field(
        default=None,
        description="403 node_banned only (always there): true when the node is banned because an "
        "admin retired its provider (the provider key lost or stolen: the node is revoked for good and "
        "the provider's money went to its successor), false for any other ban",
    )
    nonces_remembered_since: int | None = Field(
        default=None,
        description="401 nonce_replayed only, when the server lost its record of spent nonces (Redis "
        "emptied): since when (epoch seconds) it has one again; the request's signature was created "
        "earlier, so its nonce may have been spent. Sign it afresh, with a created of now and a new nonce",
    )


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = Field(description="Pass as ?cursor= to get the next page; null at the end")


RETRY_AFTER_HEADER: dict[str, Any] = {
    "description": "Seconds to wait before asking again (RFC 9110, section 10.2.3)",
    "schema": {"type": "integer", "minimum": 0},
}
# The fields a refusal carries that a client acts on (PROTOCOL.md), by status.
_PROBLEM_HEADERS: dict[int, dict[str, Any]] = {
    401: {
        "WWW-Authenticate": {
            "description": "The challenge: Signature on the signed routes, Bearer on the token routes",
            "schema": {"type": "string"},
        },
        "Accept-Signature": {
            "description": "On the signed routes: the signature to send instead (RFC 9421, section "
            '5.1), e.g. sig1=("@method" "@target-uri" "content-digest");created;alg="ed25519"; '
            "keyid and a fresh nonce are required too",
            "schema": {"type": "string"},
        },
    },
    429: {"Retry-After": RETRY_AFTER_HEADER},
    503: {"Retry-After": RETRY_AFTER_HEADER},
}

PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {
        "model": Problem,
        "content": {"application/problem+json": {}},
        "description": desc,
        **({"headers": _PROBLEM_HEADERS[code]} if code in _PROBLEM_HEADERS else {}),
    }
    for code, desc in {
        400: "Bad request: a query parameter (invalid_query) or header (invalid_header) that does not "
        "validate, a Host field that is not one authority (host_invalid), ...",
        401: "Missing or invalid credentials (signature or bearer token)",
        403: "Authenticated, but not allowed to do this",
        404: "Not found",
        409: "Conflicts with the current state",
        413: "Request body too large",
        414: "Signed request URL longer than 2048 characters (uri_too_long)",
        422: "Body does not parse or validate",
        429: "Rate limited; see Retry-After",
        503: "Service unavailable; see Retry-After. transient_conflict: the database aborted the "
        "transaction to resolve a conflict with concurrent work, nothing was recorded, send it "
        "again; database_unavailable, hot_store_unavailable: the database or Redis did not answer; "
        "hot_store_full: the in-process hot store is at its limit",
    }.items()
}
