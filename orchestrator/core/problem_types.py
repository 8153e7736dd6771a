"""The problem types: what each ``code`` of an RFC 9457 problem means, and its page.

Every problem's ``type`` is ``/problems/<code>`` (``errors.PROBLEM_TYPE_BASE``). RFC 9457,
section 3.1.1, recommends that a type URI dereference to human-readable documentation of the
type: ``GET /problems/{code}`` serves it from ``PROBLEM_TYPES``, the one registry of the codes
this server emits (tests/test_problem_types.py fails for a code the source can produce that has
no entry here, and for an entry no source produces). Each entry's meaning is taken from the
code that raises it and from README.md / docs/PROTOCOL.md, which say more.

The page is HTML by default: RFC 9457 names HTML as its example, and a person who follows a
``type`` link gets it from a browser, which renders HTML and shows text/markdown as a download
or as raw text. A client that wants to read it asks for JSON (``Accept: application/json``).
Both are built from the registry per request, with no database or hot store: cheap, and the
same for every caller until an upgrade, hence ``Cache-Control: public``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from orchestrator.core.errors import PROBLEM_MEDIA_TYPE, PROBLEM_TYPE_BASE, NotFound
from orchestrator.core.routing import GuardedRoute

PAGE_MAX_AGE_S = 86400


@dataclass(frozen=True)
class ProblemType:
    title: str
    statuses: tuple[int, ...]
    meaning: str
    action: str


def _t(title: str, statuses: tuple[int, ...], meaning: str, action: str) -> ProblemType:
    return ProblemType(title, statuses, meaning, action)


_RETRY = (
    "Wait for Retry-After, then send the request again (a signed request signed afresh, with a new nonce)."
)
_SIGNATURE = (
    "Fix the signature as docs/PROTOCOL.md ('Request signatures') and the response's "
    "Accept-Signature field say, and send the request again signed afresh, with a new nonce."
)
_NONE = "Do not send the same request again unchanged: it will be refused the same way."

PROBLEM_TYPES: dict[str, ProblemType] = {
    # ------------------------------------------------------------------ generic, by status
    "bad_request": _t("Bad request", (400,), "The request is not one the server can act on.", _NONE),
    "unauthorized": _t(
        "Not authenticated", (401,), "The request carries no valid credentials.", "Authenticate the request."
    ),
    "forbidden": _t(
        "Not permitted", (403,), "The credentials are valid but do not allow this request.", _NONE
    ),
    "not_found": _t(
        "Not found",
        (404,),
        "No route matches the method and path, or the resource does not exist (where it has no "
        "not-found code of its own).",
        "Check the path against the served OpenAPI schema (/openapi.json).",
    ),
    "method_not_allowed": _t(
        "Method not allowed",
        (405,),
        "The path exists but not with this method; the Allow field names those it takes.",
        "Use one of the methods in Allow.",
    ),
    "not_acceptable": _t(
        "Not acceptable",
        (406,),
        "The server cannot answer in a media type the Accept field allows.",
        "Send an Accept field that allows the media type the route serves (the OpenAPI schema names it).",
    ),
    "unsupported_media_type": _t(
        "Unsupported media type",
        (415,),
        "The request body's media type is not one the route takes.",
        "Send the body in a media type the route takes (a JSON body as application/json).",
    ),
    "conflict": _t(
        "Conflict",
        (409,),
        "The request conflicts with the resource's current state.",
        "Read the resource's current state before deciding what to send.",
    ),
    "http_error": _t(
        "HTTP error",
        (),
        "An HTTP error of a status this server gives no code of its own (any status; the "
        "problem's status says which).",
        "Act on the status code as RFC 9110 defines it.",
    ),
    "internal_error": _t(
        "Internal server error",
        (500,),
        "The server failed to handle the request; it logged the failure and gives no internals.",
        "Report it to the operator. A signed request may be sent again signed afresh; whether it "
        "took effect is not known (read the state first where that matters, e.g. GET "
        "/v1/nodes/me/leases after a claim).",
    ),
    # ------------------------------------------------------------------ HTTP framing
    "host_invalid": _t(
        "Bad request",
        (400,),
        "The Host field is not one RFC 3986 authority (a host name, IPv4 address or bracketed IP "
        "literal, optional :port, at most 255 characters, no userinfo, path, query or fragment), "
        "or there is more than one. Signed URLs are rebuilt from it, so it is checked on every route.",
        "Send exactly one Host field naming the server's authority.",
    ),
    "host_not_allowed": _t(
        "Bad request",
        (400,),
        "The deployment restricts the hosts signed requests may address (ORCH_SERVER__ALLOWED_HOSTS) "
        "and this request's Host is not one of them.",
        "Send the request to (and sign it for) one of the hosts the detail names.",
    ),
    "request_malformed": _t(
        "Bad request",
        (400,),
        "The request is not valid HTTP/1.1 (e.g. a header line without a colon); the connection is closed.",
        "Fix the client's HTTP framing; open a new connection.",
    ),
    "header_fields_too_large": _t(
        "Request header fields too large",
        (431,),
        "The request line and header fields go on past 64 KiB; the connection is closed.",
        "Send a shorter request line and fewer or shorter header fields, on a new connection.",
    ),
    "payload_too_large": _t(
        "Payload too large",
        (413,),
        "The request body is larger than the server takes (ORCH_LIMITS__MAX_BODY_BYTES); it was "
        "refused before it was parsed.",
        "Send a smaller body.",
    ),
    "uri_too_long": _t(
        "URI too long",
        (414,),
        "A signed request's URL (scheme, Host, path and query) is longer than 2048 characters; "
        "refused before its signature is checked.",
        "Send a shorter URL.",
    ),
    # ------------------------------------------------------------------ input
    "validation_failed": _t(
        "Request did not validate",
        (422,),
        "The body does not parse or validate: not a JSON object sent as application/json, a field "
        "missing, of the wrong type or out of range, or a field the server does not know. "
        "errors lists each place.",
        "Fix the body as the errors and the served OpenAPI schema say.",
    ),
    "invalid_query": _t(
        "Query parameters did not validate",
        (400,),
        "A query parameter does not validate (wrong type, out of range, a NUL character); "
        "errors lists each place.",
        "Fix the query as the errors and the served OpenAPI schema say.",
    ),
    "invalid_header": _t(
        "Request headers did not validate",
        (400,),
        "A header field does not validate, e.g. an Idempotency-Key that is not 8 to 100 letters, "
        "digits, '.', '_', ':' and '-', or sent more than once.",
        "Fix the header field as the detail says.",
    ),
    "cursor_invalid": _t(
        "Bad request",
        (400,),
        "A list's cursor is not one this list issued (another list's, or a position the list never reached).",
        "Start the list again without a cursor, or pass the previous page's next_cursor as it was.",
    ),
    # ------------------------------------------------------------------ signatures (RFC 9421)
    "signature_missing": _t(
        "Request signature refused",
        (401,),
        "The request carries no Signature-Input and Signature fields.",
        _SIGNATURE,
    ),
    "signature_malformed": _t(
        "Request signature refused",
        (401,),
        "Signature-Input or Signature cannot be read: not a structured-field dictionary, longer "
        "than 4096 bytes, more than 8 signatures, different labels in the two fields, a nonce "
        "not of 8 to 128 characters, parameters of the wrong type, or more than one signature "
        "that verifies.",
        _SIGNATURE,
    ),
    "signature_param_missing": _t(
        "Request signature refused",
        (401,),
        "The signature lacks a required parameter: keyid, created or nonce.",
        _SIGNATURE,
    ),
    "unsupported_algorithm": _t(
        "Request signature refused", (401,), "The signature's alg is not ed25519.", _SIGNATURE
    ),
    "signature_expired": _t(
        "Request signature refused", (401,), "The signature's expires time has passed.", _SIGNATURE
    ),
    "signature_stale": _t(
        "Request signature refused",
        (401,),
        "The signature's created is further in the past than the server's window (300 s by default).",
        "Check the client's clock; sign the request afresh, with a new nonce.",
    ),
    "signature_from_future": _t(
        "Request signature refused",
        (401,),
        "The signature's created is further in the future than the server's window (300 s by default).",
        "Check the client's clock; sign the request afresh, with a new nonce.",
    ),
    "signature_coverage_insufficient": _t(
        "Request signature refused",
        (401,),
        "The signature does not cover what it must: @method, the request target (@target-uri, "
        "or @path plus @query when the query is not empty) and, with a body, content-digest.",
        _SIGNATURE,
    ),
    "digest_missing": _t(
        "Request signature refused",
        (401,),
        "A request with a body carries no Content-Digest field (RFC 9530).",
        "Send a Content-Digest (sha-256 or sha-512) of the body and cover it in the signature.",
    ),
    "digest_malformed": _t(
        "Request signature refused",
        (401,),
        "Content-Digest cannot be read, or holds no sha-256 or sha-512 digest of the right length.",
        "Send a sha-256 or sha-512 Content-Digest of the body as RFC 9530 spells it.",
    ),
    "digest_mismatch": _t(
        "Request signature refused",
        (401,),
        "A sha-256 or sha-512 digest in Content-Digest does not match the body received.",
        "Compute the digest over the exact bytes sent, and sign afresh.",
    ),
    "unknown_key": _t(
        "Request signature refused",
        (401,),
        "The signature's keyid is not a registered key of the kind the route needs (a node for "
        "node routes, a provider for provider routes), or is not an Ed25519 key id at all.",
        "Register the key first (POST /v1/nodes or POST /v1/providers), or sign with the right key.",
    ),
    "signature_invalid": _t(
        "Request signature refused",
        (401,),
        "The signature does not verify for this request with the key on file (or the URL cannot "
        "be covered by a signature).",
        "Sign exactly the request sent (method, URL as sent, covered fields), with the key named in keyid.",
    ),
    "nonce_replayed": _t(
        "Request signature refused",
        (401,),
        "The nonce was already used with this key within the window: a replay, or a request "
        "sent again after its nonce was spent (a 503 from the request's own work spends it). With "
        "nonces_remembered_since (epoch seconds): the server's Redis lost its record of spent "
        "nonces, and every request created before that time is refused as a possible replay.",
        "Sign the request afresh, with a new nonce (and, with nonces_remembered_since, a created "
        "not earlier than it).",
    ),
    # ------------------------------------------------------------------ bearer tokens
    "token_missing": _t(
        "Not authenticated",
        (401,),
        "The route needs a bearer token and none was sent.",
        "Send Authorization: Bearer <token>.",
    ),
    "token_invalid": _t(
        "Not authenticated",
        (401,),
        "The bearer token is not one this server accepts.",
        "Use a valid token; an admin issues them.",
    ),
    "token_expired": _t(
        "Token expired",
        (401, 409),
        "401: the bearer token has expired. 409: an admin rotation of an expired token that "
        "gives it no new lifetime.",
        "401: use a current token. 409: give the token a new lifetime (expires_in_s, or null for none).",
    ),
    "token_revoked": _t(
        "Conflict", (409,), "The token was revoked, for good: it cannot be rotated.", "Create a new token."
    ),
    "token_not_found": _t(
        "Not found", (404,), "No token with this id.", "Check the token id (GET /v1/admin/tokens)."
    ),
    "token_scope_invalid": _t(
        "Request did not validate",
        (422,),
        "A token's pool scope does not fit its role: a validator or trainer token without a pool, "
        "a pool that does not exist, or pools given to a role that is not scoped to pools.",
        "Fix the token's role or pools as the detail says.",
    ),
    "role_forbidden": _t(
        "Not permitted",
        (403,),
        "The token's role may not do this; the detail names the roles that may.",
        "Use a token of one of those roles.",
    ),
    # ------------------------------------------------------------------ identity
    "attestation_invalid": _t(
        "Not permitted",
        (403,),
        "A node registration's attestation is not the provider's Ed25519 signature over "
        "'orchestrator/v1/attest-node:' + node id.",
        "Sign the attestation with the provider key named in provider_id.",
    ),
    "node_banned": _t(
        "Not permitted",
        (403,),
        "The node is banned (by an admin, by its provider's revocation of its key, or because "
        "an admin retired its provider, which the problem says with provider_retired: true): every "
        "request its key signs is refused.",
        "Stop using the key. A revoked key never comes back: register a new node key (after a "
        "retirement, under the successor provider); an admin's ban ends only when an admin lifts it.",
    ),
    "node_key_revoked": _t(
        "Not permitted",
        (403,),
        "A registration of a node key that its provider revoked, for good, whatever the attestation.",
        "Generate a new node key (orchestrator keys generate) and register that.",
    ),
    "node_revoked": _t(
        "Conflict",
        (409,),
        "An unban of a node whose provider revoked its key: a revoked key cannot be unbanned.",
        "The provider registers a new node key.",
    ),
    "node_bound_to_other_provider": _t(
        "Conflict",
        (409,),
        "The node key is already registered under another provider.",
        "Register a new node key for this provider.",
    ),
    "node_key_is_provider_key": _t(
        "Request did not validate",
        (422,),
        "A node registration (POST /v1/nodes) signed with a key registered as a provider: a node "
        "signs with a key of its own, and the key that gets paid stays off the workers' machines.",
        "Generate a node key (orchestrator keys generate) and register that.",
    ),
    "provider_key_is_node_key": _t(
        "Request did not validate",
        (422,),
        "A provider registration (POST /v1/providers) signed with a key registered as a node.",
        "Generate a separate provider key and keep it off the workers' machines.",
    ),
    "provider_retired": _t(
        "Provider retired",
        (403, 409),
        "403: a request signed with the key of a provider an admin retired (its key lost or "
        "stolen; its money went to its successor), its registration included, or a node "
        "registration naming it. 409: a retirement of a provider already retired, under another "
        "Idempotency-Key.",
        "403: sign with the successor's key; the retired key can do nothing any more. 409: nothing "
        "to do; the retirement stands.",
    ),
    "successor_is_provider": _t(
        "Request did not validate",
        (422,),
        "A retirement names the retired provider as its own successor.",
        "Name another registered provider, whose key is safe.",
    ),
    "successor_not_found": _t(
        "Request did not validate",
        (422,),
        "A retirement's successor is not a registered provider.",
        "The successor registers first (POST /v1/providers).",
    ),
    "successor_retired": _t(
        "Conflict",
        (409,),
        "A retirement's successor is retired itself.",
        "Name its successor, or another provider.",
    ),
    "provider_not_found": _t(
        "Not found",
        (404,),
        "No provider with this id (for a node registration: the provider is not registered yet).",
        "Register the provider first (POST /v1/providers), or check the id.",
    ),
    "node_not_found": _t(
        "Not found",
        (404,),
        "No node with this id (for a provider's routes: none of this provider's nodes).",
        "Check the node id.",
    ),
    "ip_cap": _t(
        "Too many nodes at this address",
        (403, 409),
        "The pool's max_nodes_per_ip would be passed: 403 for a join (a refusal reason), 409 for "
        "a node registering again from an address that already has as many nodes as allowed in "
        "a pool the node is a member of (nothing changed; pools names them).",
        "Leave those pools first, or register (join) from another address.",
    ),
    # ------------------------------------------------------------------ rate limits, availability
    "rate_limited": _t(
        "Too many requests",
        (429,),
        "A rate limit was passed: registrations per address and per key, signed requests per key "
        "in a 10 s window, or requests of keys the process has not seen per address. Nothing was "
        "done and the nonce was not spent.",
        "Wait for Retry-After; the same signed request may then be sent again while its created "
        "is within the window.",
    ),
    "not_ready": _t(
        "Service unavailable",
        (503,),
        "The service is not ready (GET /readyz: the database or hot store does not answer).",
        _RETRY,
    ),
    "transient_conflict": _t(
        "Service unavailable",
        (503,),
        "The database aborted the request's transaction to resolve a conflict with concurrent "
        "work (cause: deadlock_detected, serialization_failure, lock_not_available, "
        "database_locked), or a concurrent request took what it needed; nothing was recorded.",
        _RETRY + " Safe even for a claim.",
    ),
    "database_unavailable": _t(
        "Service unavailable",
        (503,),
        "The database could not be reached or dropped the request's connection; the request did "
        "not complete (a connection lost while committing may have committed it).",
        _RETRY,
    ),
    "hot_store_unavailable": _t(
        "Service unavailable",
        (503,),
        "The hot store (Redis) did not answer in time or refused the write; the request was not completed.",
        _RETRY,
    ),
    "hot_store_full": _t(
        "Service unavailable",
        (503,),
        "The in-process hot store (a deployment without Redis) holds as many live entries as its "
        "limit allows.",
        _RETRY,
    ),
    "feed_busy": _t(
        "Service unavailable",
        (503,),
        "The verdict feed waits for transactions still writing verdicts.",
        _RETRY,
    ),
    # ------------------------------------------------------------------ pools and memberships
    "pool_not_found": _t(
        "Not found",
        (404,),
        "No pool with this id (or one the caller may not see).",
        "Check the pool id (GET /v1/pools).",
    ),
    "member_not_found": _t(
        "Not found", (404,), "The node has no membership in the pool.", "Check the node and pool ids."
    ),
    "not_a_member": _t(
        "Not permitted",
        (403,),
        "The node is not a member of the pool (e.g. leaving a pool it never joined).",
        "Join the pool first (POST /v1/pools/{pool_id}/join).",
    ),
    "pool_not_active": _t(
        "Join refused",
        (403,),
        "A join refused: the pool is not active (the detail gives its status). A join's refusal "
        "is 403 with the first unmet rule as its code and reasons listing them all.",
        "Wait for the pool to be activated, or choose another pool (GET /v1/pools).",
    ),
    "node_ejected": _t(
        "Join refused",
        (403,),
        "A join refused: the node was ejected from the pool and cannot rejoin.",
        "Choose another pool.",
    ),
    "provider_blacklisted": _t(
        "Join refused",
        (403,),
        "A join refused: the node's provider is blacklisted from the pool.",
        "Choose another pool.",
    ),
    "requirements_unmet": _t(
        "Join refused",
        (403,),
        "A join refused: the node's specs meet none of the pool's requirement alternatives "
        "(alternatives gives each one's failed checks).",
        "Join with a node that meets the requirements (GET /v1/pools lists them).",
    ),
    "invite_required": _t(
        "Join refused",
        (403,),
        "A join refused: the pool admits nodes by invite code only, and none was sent.",
        "Join with an invite code from the pool's operator.",
    ),
    "invite_invalid": _t(
        "Join refused",
        (403,),
        "A join refused: the invite code is unknown, for another pool, already used or expired.",
        "Ask the pool's operator for a new invite code.",
    ),
    "pool_full": _t(
        "Join refused",
        (403,),
        "A join refused: the pool has max_nodes members already.",
        "Try again later, or choose another pool.",
    ),
    "provider_cap": _t(
        "Join refused",
        (403,),
        "A join refused: the node's provider already has max_nodes_per_provider nodes in the pool.",
        "Leave the pool with another of the provider's nodes first, or choose another pool.",
    ),
    "stake_insufficient": _t(
        "Join refused",
        (403,),
        "A join refused: the provider has less free stake than the pool's min_stake_per_node.",
        "Deposit stake for the provider, then join again.",
    ),
    "membership_not_pending": _t(
        "Conflict",
        (409,),
        "An approval or rejection of a membership that is not pending.",
        "Read the membership's status first.",
    ),
    "pool_transition_invalid": _t(
        "Conflict",
        (409,),
        "The pool cannot make this change from its current status (pool_status, allowed_actions).",
        "Use one of the allowed actions.",
    ),
    "pool_completed": _t(
        "Conflict", (409,), "The pool is completed and can no longer change (no tasks, no policy).", _NONE
    ),
    "budget_spent": _t(
        "Conflict",
        (409,),
        "A resume or activation while the pool's verdicts have credited its economics.reward_budget "
        "(rewards_credited, reward_budget).",
        "Raise the budget above what is credited, or set it to null, first.",
    ),
    "replication_exceeds_max_nodes": _t(
        "Conflict",
        (409,),
        "Replicas go to different nodes: tasks whose replication is above the pool's "
        "caps.max_nodes, or a caps.max_nodes below the replicas of open tasks, could never be done.",
        "Lower the replication or raise caps.max_nodes (or let the open tasks finish first).",
    ),
    # ------------------------------------------------------------------ tasks, leases, results
    "task_not_found": _t("Not found", (404,), "No task with this id in this pool.", "Check the task id."),
    "assignment_not_found": _t(
        "Not found",
        (404,),
        "No assignment (lease) with this id for this node: missing, or another node's.",
        "Check the assignment id (GET /v1/nodes/me/leases lists the node's).",
    ),
    "no_policy": _t(
        "Not found",
        (404,),
        "No policy has been published for this pool yet.",
        "Wait for the trainer to publish one.",
    ),
    "policy_step_not_increasing": _t(
        "Conflict",
        (409,),
        "A policy publication whose step is not greater than the current step (or a step already "
        "published with another checkpoint).",
        "Publish with a step greater than current_step.",
    ),
    "batch_key_reused": _t(
        "Conflict",
        (409,),
        "A known batch_key sent with tasks that say something else.",
        "Use a new batch_key for new tasks; resend the same batch unchanged to get its first answer.",
    ),
    "reward_exceeds_ledger_limit": _t(
        "Conflict",
        (409,),
        "The pool's reward_per_sample times a task's n exceeds the largest amount the ledger moves "
        "at once: the reward could never be paid.",
        "Lower the pool's reward_per_sample or the tasks' n.",
    ),
    "deadline_passed": _t(
        "Deadline passed",
        (409, 422),
        "409: the task's deadline passed; the result is not recorded. 422: a task (or ReST^EM "
        "iteration) enqueued with a deadline_at already past.",
        "409: drop the lease. 422: send a deadline_at in the future.",
    ),
    "lease_expired": _t(
        "Conflict",
        (409,),
        "The lease (a task's, or a validation job's) ran out or was reissued to someone else; "
        "the result is not recorded.",
        "Drop the lease; claim new work.",
    ),
    "task_cancelled": _t(
        "Conflict",
        (409,),
        "The lease was withdrawn because its task ended (task_status, end_reason: cancelled "
        "by an operator, or failed when another replica ran out of attempts); the result is not recorded.",
        "Drop the lease; claim new work.",
    ),
    "result_conflict": _t(
        "Conflict",
        (409,),
        "A different result was already recorded for this assignment (the same result spelled "
        "otherwise is answered as the first time, unless the body sent is less than an eighth of "
        "the recorded one's size: that one is not compared).",
        _NONE,
    ),
    "policy_unknown": _t(
        "Conflict",
        (409,),
        "The result's policy_step was never published in the pool.",
        "Answer with the policy step the lease gave (GET /v1/pools/{pool_id}/policy).",
    ),
    "policy_stale": _t(
        "Conflict",
        (409,),
        "The result's policy_step is more than the pool's max_async_level steps behind the current one.",
        "Load the current policy (GET /v1/pools/{pool_id}/policy) before answering further leases.",
    ),
    # ------------------------------------------------------------------ ReST^EM
    "iteration_running": _t(
        "Conflict",
        (409,),
        "A ReST^EM iteration is still running in this pool (or was created concurrently).",
        "Wait for it to complete or expire.",
    ),
    "iteration_name_taken": _t(
        "Conflict",
        (409,),
        "An iteration with this name already exists with another body.",
        "Use another name, or send the same body.",
    ),
    "iteration_not_found": _t(
        "Not found", (404,), "No ReST^EM iteration with this id in this pool.", "Check the id."
    ),
    "policy_not_current": _t(
        "Conflict",
        (409,),
        "The iteration's policy_step is not the pool's current policy step.",
        "Send the current policy step.",
    ),
    # ------------------------------------------------------------------ verification
    "verdict_not_found": _t("Not found", (404,), "No verdict with this id.", "Check the verdict id."),
    "validation_job_not_found": _t(
        "Not found", (404,), "No validation job with this id.", "Check the job id."
    ),
    "verdict_conflict": _t(
        "Conflict", (409,), "A different verdict was already recorded for this validation job.", _NONE
    ),
    "validation_withdrawn": _t(
        "Conflict",
        (409,),
        "The validation job waited past the validator wait with no validator holding a live lease; "
        "it was withdrawn and decided on the server's checks, so no verdict or extension is recorded.",
        "Drop the job; claim new ones.",
    ),
    "evidence_contradicts": _t(
        "Request did not validate",
        (422,),
        "A valid verdict whose evidence (TOPLOC numbers) fails the thresholds sent with it.",
        "Send a verdict that agrees with its evidence.",
    ),
    "reversal_impossible": _t(
        "Conflict",
        (409,),
        "The verdict's money has moved on (e.g. the reward was withdrawn); it cannot be reversed.",
        _NONE,
    ),
    # ------------------------------------------------------------------ ledger and payouts
    "insufficient_funds": _t(
        "Conflict",
        (409,),
        "The account holds less than the amount asked (e.g. less claimable than a withdrawal "
        "asks); nothing moved.",
        "Ask for at most what the balance shows (GET /v1/providers/me/balance).",
    ),
    "idempotency_key_reused": _t(
        "Conflict",
        (409,),
        "A known Idempotency-Key sent with a request that says something else (another amount, "
        "reference, successor or max_payouts).",
        "Use a new key for a new request; the same request with the same key answers the first.",
    ),
    "balance_limit_exceeded": _t(
        "Conflict",
        (409,),
        "The transfer would carry a balance past the ledger's 64-bit bound, +/-(2^63 - 1); nothing moved.",
        _NONE,
    ),
    "payout_not_found": _t("Not found", (404,), "No payout with this id.", "Check the payout id."),
    "payout_run_not_found": _t("Not found", (404,), "No payout run with this id.", "Check the run id."),
    "payout_already_paid": _t(
        "Conflict",
        (409,),
        "The payout is already marked paid with another reference (external_reference), or "
        "a reject of a paid payout.",
        _NONE,
    ),
    "payout_rejected": _t(
        "Conflict",
        (409,),
        "Marking a rejected payout paid (rejection_reason): its amount went back to the provider.",
        _NONE,
    ),
    "nothing_to_settle": _t(
        "Conflict",
        (409,),
        "A payout run found no requested payout outside a run to take; no run is recorded.",
        "Start a run once payouts are requested.",
    ),
    # ------------------------------------------------------------------ this page
    "problem_type_not_found": _t(
        "Not found",
        (404,),
        "No problem type with this code: GET /problems/{code} serves the codes this server emits.",
        "Check the code (the code of the problem received).",
    ),
}


def page_html(code: str, problem: ProblemType) -> str:
    e = html.escape
    statuses = ", ".join(str(s) for s in problem.statuses) or "any (the problem's status says which)"
    return (
        "<!doctype html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{e(code)}: {e(problem.title)}</title></head>\n'
        f"<body><h1><code>{e(code)}</code>: {e(problem.title)}</h1>\n"
        f"<p>HTTP status: {statuses}. An RFC 9457 problem (<code>application/problem+json</code>) "
        f"whose <code>type</code> is <code>{e(PROBLEM_TYPE_BASE + code)}</code>.</p>\n"
        f"<h2>Meaning</h2><p>{e(problem.meaning)}</p>\n"
        f"<h2>What to do</h2><p>{e(problem.action)}</p>\n"
        "<p>The problem's <code>detail</code> says more about each occurrence; see docs/PROTOCOL.md "
        "and README.md.</p></body></html>\n"
    )


def page_json(code: str, problem: ProblemType) -> dict[str, Any]:
    return {
        "type": PROBLEM_TYPE_BASE + code,
        "code": code,
        "title": problem.title,
        "statuses": list(problem.statuses),
        "meaning": problem.meaning,
        "action": problem.action,
    }


def _ranks_json_first(accept: str) -> bool:
    """Whether the Accept field prefers application/json to text/html (RFC 9110, section
    12.5.1: each media range's q, the most specific range that matches a type deciding it).
    No field, or one that ranks them alike, is the HTML page: a browser's."""
    ranges: list[tuple[str, float]] = []
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        ranges.append((media.lower(), q))

    def q_of(media: str) -> float:
        kind = media.split("/")[0] + "/*"
        for candidate in (media, kind, "*/*"):
            qs = [q for m, q in ranges if m == candidate]
            if qs:
                return max(qs)
        return 0.0

    return q_of("application/json") > q_of("text/html")


router = APIRouter(tags=["operations"], route_class=GuardedRoute)


@router.get(
    "/problems/{code}",
    summary="What a problem's code means (its RFC 9457 type URI); unauthenticated",
    response_class=HTMLResponse,
    responses={
        200: {
            "description": "The problem type's page: HTML, or JSON when Accept ranks application/json first",
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["type", "code", "title", "statuses", "meaning", "action"],
                        "properties": {
                            "type": {"type": "string"},
                            "code": {"type": "string"},
                            "title": {"type": "string"},
                            "statuses": {"type": "array", "items": {"type": "integer"}},
                            "meaning": {"type": "string"},
                            "action": {"type": "string"},
                        },
                    }
                }
            },
        },
        404: {
            "description": "No problem type with this code (problem_type_not_found)",
            "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        },
    },
)
async def problem_page(code: str, request: Request) -> Response:
    problem = PROBLEM_TYPES.get(code)
    if problem is None:
        raise NotFound(f"no problem type {code[:100]!r}", code="problem_type_not_found")
    # The same for every caller until the server is upgraded: cacheable, negotiated on Accept.
    headers = {"Cache-Control": f"public, max-age={PAGE_MAX_AGE_S}", "Vary": "Accept"}
    if _ranks_json_first(request.headers.get("accept", "")):
        return JSONResponse(page_json(code, problem), headers=headers)
    return HTMLResponse(page_html(code, problem), headers=headers)
