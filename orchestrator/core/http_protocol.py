"""The HTTP/1.1 protocol ``orchestrator serve`` runs: uvicorn's httptools protocol, with a bound
on the size of a request's head (its request line and header fields).

httptools (llhttp) keeps a header field whole until it ends, and uvicorn sets no limit on it:
a client held as much of the server's memory as it sent before its head ended (four requests
with a header field of 300 MB each took 1.5 GB), before any check of the app could run.
uvicorn's h11 protocol has such a limit, but parses a third slower. Here a request whose head
passes ``MAX_HEAD_BYTES`` is answered 431 ``header_fields_too_large`` (RFC 6585), as a problem,
and its connection is closed.

The bytes of a head are counted as they arrive: every chunk read while a head is under way
that neither starts the request nor ends its head (such a chunk may carry another request's
end or this one's body, which are not the head's), so a head is refused at most two reads
(some 256 KiB each) past the limit and a body is never counted.

A request line whose target is 64 KiB or more, which httptools cannot parse, is refused the same
way, and a request that is not HTTP/1.1 at all is a 400 ``request_malformed`` problem: uvicorn
answered both with a ``text/plain`` 400, "Invalid HTTP request received."
"""

from __future__ import annotations

from typing import Any

import orjson
import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orchestrator.core.errors import PROBLEM_MEDIA_TYPE, problem_body

# The request line and every header field of one request. A signed request's own fields are far
# smaller (Signature-Input and Signature at most 4 KiB each, the signed URL at most 2 KiB), and a
# proxy such as nginx refuses more than 32 KiB by default.
MAX_HEAD_BYTES = 64 * 1024
# The longest request target httptools.parse_url takes (its offsets are 16-bit).
MAX_URL_BYTES = 2**16 - 1

log = structlog.get_logger(__name__)


class BoundedHeadProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that refuses a request head longer than ``MAX_HEAD_BYTES``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes counted of the head under way; None while a body is read.
        self._head_bytes: int | None = 0
        self._requests_begun = 0

    def data_received(self, data: bytes) -> None:
        begun = self._requests_begun
        super().data_received(data)
        if self._head_bytes is None or self._requests_begun != begun or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_head()

    def on_message_begin(self) -> None:
        self._requests_begun += 1
        self._head_bytes = 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request httptools refused: a problem, as every error is."""
        if len(getattr(self, "url", b"")) > MAX_URL_BYTES:
            self._refuse_head()
            return
        log.warning("request_malformed", client=self.client)
        self._refuse(
            400,
            "Bad Request",
            code="request_malformed",
            title="Bad request",
            detail="the request is not valid HTTP/1.1; the connection is closed",
        )

    def _refuse_head(self) -> None:
        log.warning("request_head_too_large", limit=MAX_HEAD_BYTES, client=self.client)
        self._refuse(
            431,
            "Request Header Fields Too Large",
            code="header_fields_too_large",
            title="Request header fields too large",
            detail=f"the request line and header fields exceed {MAX_HEAD_BYTES} bytes",
        )

    def _refuse(self, status: int, reason: str, *, code: str, title: str, detail: str) -> None:
        """Answer ``status`` (its status line's ``reason``) as a problem; close the connection."""
        body = orjson.dumps(problem_body(status=status, code=code, title=title, detail=detail))
        self.transport.write(
            f"HTTP/1.1 {status} {reason}\r\n".encode()
            + f"content-type: {PROBLEM_MEDIA_TYPE}\r\n".encode()
            + f"content-length: {len(body)}\r\n".encode()
            + b"connection: close\r\n\r\n"
            + body
        )
        self.transport.close()
