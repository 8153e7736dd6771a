"""A result's evidence checked again: the exact signed request, verified as it was received.

Every accepted result keeps the request's method, URL, body and every signed header field, so
anyone may later check that the node holding the lease signed exactly this body for exactly
this URL, without trusting this server's word (PROTOCOL.md; ``docs/architecture.md``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from urllib.parse import urlsplit

from orchestrator.core.errors import Unauthorized
from orchestrator.core.signing import verify_request
from orchestrator.tasks.models import Submission


@dataclass(frozen=True)
class EvidenceCheck:
    valid: bool
    keyid: str | None = None
    code: str | None = None
    detail: str | None = None


def covered_lines(sub: Submission) -> list[tuple[str, str]]:
    """The header lines the signature covers, as stored (results stored before the covered
    fields were kept have only their Content-Digest)."""
    if sub.signed_fields is not None:
        return [(name, value) for name, value in sub.signed_fields]
    return [("content-digest", sub.content_digest)] if sub.content_digest is not None else []


# Stored in their own columns, whole: a signature may cover Signature-Input itself (RFC 9421
# does not forbid it), and passing its covered line as well would make two of the field.
_OWN_COLUMNS = frozenset({"signature-input", "signature"})


def recheck(sub: Submission, *, window_s: int) -> EvidenceCheck:
    """Verify ``sub``'s stored request again, at the time it was received and with the
    ``created`` window it was checked against then (``window_s``, today's setting, for results
    stored before that was kept), the nonce aside (it was spent then), and that its key is the
    node's that held the lease."""
    if sub.evidence_pruned_at is not None:
        return EvidenceCheck(
            False,
            code="evidence_pruned",
            detail=f"the body was pruned on {sub.evidence_pruned_at:%Y-%m-%d %H:%M} UTC "
            "(orchestrator admin prune-evidence): check the one its archive holds",
        )
    if hashlib.sha256(sub.body).hexdigest() != sub.body_sha256:
        return EvidenceCheck(False, code="body_altered", detail="the stored body does not match its SHA-256")
    try:
        signed = verify_request(
            method=sub.method,
            url=sub.target_uri,
            query=urlsplit(sub.target_uri).query,
            headers=[
                ("signature-input", sub.signature_input),
                ("signature", sub.signature),
                *((name, value) for name, value in covered_lines(sub) if name not in _OWN_COLUMNS),
            ],
            body=sub.body,
            now=sub.received_at.timestamp(),
            window_s=sub.signature_window_s or window_s,
        )
    except Unauthorized as exc:
        return EvidenceCheck(False, code=exc.code, detail=exc.detail)
    if signed.keyid != sub.node_id:
        return EvidenceCheck(
            False, keyid=signed.keyid, code="signer_mismatch", detail="signed by a key other than the node's"
        )
    return EvidenceCheck(True, keyid=signed.keyid)
