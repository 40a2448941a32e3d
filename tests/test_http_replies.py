"""The check that keeps a cut HTTP reply from passing for an answer (pure logic).

The same replies from a real server, cut by a proxy, are in ``test_deadlines.py``.
"""

from __future__ import annotations

import zlib

import pytest
from botocore.awsrequest import HeadersDict

from dedupstore.backends.dynamodb._client import _TRANSIENT_ERRORS, _CutShort, _refuse_cut_replies
from dedupstore.replies import cut_short

BODY = b'{"Responses": {"t": [{"pk": {"S": "a"}}]}}'


@pytest.mark.parametrize(
    ("status", "headers", "received", "whole"),
    [
        (200, {"Content-Length": str(len(BODY))}, len(BODY), True),
        (200, {"content-length": "0"}, 0, True),
        (200, {"Transfer-Encoding": "chunked"}, 7, True),  # the HTTP client checks chunks
        (204, {}, 0, True),
        (304, {}, 0, True),
        (100, {}, 0, True),
        (200, {"Content-Length": str(len(BODY))}, len(BODY) - 1, False),
        (200, {"Content-Length": str(len(BODY))}, 0, False),
        (400, {"Content-Length": "50"}, 10, False),  # an error cut short is no error answer
        (200, {"Content-Length": "5"}, 6, False),
        (200, {"Content-Length": "five"}, 5, False),
        (200, {}, 0, False),  # the headers were cut before the length
        (200, {"Content-Type": "application/json"}, 12, False),
    ],
)
def test_a_reply_is_whole_only_with_its_declared_length(
    status: int, headers: dict[str, str], received: int, whole: bool
) -> None:
    reason = cut_short(status, HeadersDict(headers), received)
    assert (reason is None) is whole
    if reason is not None:
        assert f"HTTP {status}" in reason


def _reply(body: bytes, **headers: str) -> dict[str, object]:
    return {"status_code": 200, "headers": HeadersDict(headers), "body": body}


def test_dynamodb_refuses_a_reply_whose_crc32_does_not_match() -> None:
    """A whole-looking reply whose body is not the one DynamoDB summed is refused."""
    good = str(zlib.crc32(BODY))
    _refuse_cut_replies(_reply(BODY, **{"Content-Length": str(len(BODY)), "x-amz-crc32": good}))
    _refuse_cut_replies(_reply(BODY, **{"Content-Length": str(len(BODY))}))  # no sum: length only
    other = BODY.replace(b"a", b"b")
    with pytest.raises(_CutShort, match="CRC32"):
        _refuse_cut_replies(
            _reply(other, **{"Content-Length": str(len(other)), "x-amz-crc32": good})
        )
    with pytest.raises(_CutShort, match="3 bytes of a"):
        _refuse_cut_replies(_reply(BODY[:3], **{"Content-Length": str(len(BODY))}))
    assert issubclass(_CutShort, _TRANSIENT_ERRORS)  # retried as a lost answer
