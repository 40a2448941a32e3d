"""The check the HTTP backends (DynamoDB, Cosmos DB) make before believing a reply.

A server killed while writing a reply leaves a status line, maybe some headers and part of the body,
then an orderly end of file. botocore does not check a body against its ``Content-Length`` (it turns
urllib3's check off) and parses an empty or cut one as an empty answer (``{}``: "no such item", "no
responses"); a reply cut inside its headers has no length to check, and both SDKs read its empty
body as "nothing". Taken as an answer, that is "not processed" or "a new entity": the one answer a
deduplication store must never make up. Each backend runs :func:`cut_short` on every reply and
raises its transport's connection-error type when it names a reason, so the call is retried like any
lost answer, then fails with ``StoreUnavailable``.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["cut_short"]


def cut_short(status: int, headers: Mapping[str, str], received: int) -> str | None:
    """Why the reply is not whole, or ``None`` when it is. ``received``: the bytes of body read from
    the wire (before any decompression). Whole: a body of exactly its ``Content-Length``, or chunked
    (the HTTP client itself fails on a missing chunk), or a status without a body (1xx, 204, 304).
    ``headers`` must be case-insensitive (both SDKs' are)."""
    if status < 200 or status in (204, 304):
        return None
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return None
    declared = headers.get("content-length")
    if declared is None:
        return f"HTTP {status} without a Content-Length (its headers were cut short?)"
    if not declared.strip().isdigit() or int(declared) != received:
        return f"HTTP {status} with {received} bytes of a {declared.strip()}-byte body"
    return None
