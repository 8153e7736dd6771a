"""Ed25519 identities: key ids, attestations and key files (PyNaCl).

A provider's or node's id is its raw 32-byte public key in unpadded base64url
(43 characters); that id is also its RFC 9421 ``keyid``.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
from pathlib import Path

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

ATTESTATION_CONTEXT = b"orchestrator/v1/attest-node:"
KEY_ID_RE = re.compile(r"^[A-Za-z0-9_-]{43}$")


def b64u_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64u_decode(text: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise ValueError("not unpadded base64url")
    padded = text + "=" * (-len(text) % 4)
    try:
        return base64.urlsafe_b64decode(padded)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("not unpadded base64url") from exc


def is_key_id(value: str) -> bool:
    """True when ``value`` is the canonical encoding of a 32-byte key."""
    if not KEY_ID_RE.fullmatch(value):
        return False
    raw = b64u_decode(value)
    return len(raw) == 32 and b64u_encode(raw) == value


def key_id_of(key: SigningKey | VerifyKey) -> str:
    verify_key = key.verify_key if isinstance(key, SigningKey) else key
    return b64u_encode(bytes(verify_key))


def verify_key_for(key_id: str) -> VerifyKey:
    if not is_key_id(key_id):
        raise ValueError("not a key id")
    return VerifyKey(b64u_decode(key_id))


def attestation_message(node_id: str) -> bytes:
    return ATTESTATION_CONTEXT + node_id.encode("utf-8")


def attest_node(provider_key: SigningKey, node_id: str) -> str:
    """The provider's detached signature over the node id, unpadded base64url."""
    return b64u_encode(provider_key.sign(attestation_message(node_id)).signature)


def verify_attestation(provider_id: str, node_id: str, attestation: str) -> bool:
    try:
        signature = b64u_decode(attestation)
        if len(signature) != 64:
            return False
        verify_key_for(provider_id).verify(attestation_message(node_id), signature)
    except (ValueError, BadSignatureError):
        return False
    return True


def generate_key() -> SigningKey:
    return SigningKey.generate()


def write_key_file(path: Path, key: SigningKey, *, force: bool = False) -> None:
    """Write the 32-byte seed as base64url text, readable by the owner only (0600)."""
    if (path.exists() or path.is_symlink()) and not force:
        raise FileExistsError(
            f"{path} exists and was left as it is: if its key is registered, overwriting it loses "
            "that identity (and what is owed to it). Choose another file, or pass --force to "
            "replace it"
        )
    # Never through a symlink, nor into a file another run creates meanwhile (O_EXCL); a
    # replacement (--force) is written beside the file and renamed over it, so it replaces a
    # symlink itself rather than the file it points to, and is never a readable or torn file.
    target = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp") if force else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(b64u_encode(bytes(key)) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if force:
            os.replace(target, path)
    except BaseException:
        if force:
            target.unlink(missing_ok=True)
        raise


def read_key_file(path: Path) -> SigningKey:
    raw = b64u_decode(path.read_text().strip())
    if len(raw) != 32:
        raise ValueError(f"{path} does not hold a 32-byte Ed25519 seed")
    return SigningKey(raw)
