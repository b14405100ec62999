"""PutChunk by hand: the same bytes protobuf writes, and parsed as protobuf parses them."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.codec import decode_put_chunk, encode_put_chunk
from tierkv.errors import InvalidArgumentError
from tierkv.wire import tierkv_pb2 as pb

headers = st.one_of(st.none(), st.builds(
    pb.PutHeader,
    hashes=st.lists(st.binary(min_size=0, max_size=40), max_size=4),
    write_policy=st.integers(0, 2), priority=st.integers(0, 4),
))


@settings(max_examples=200, deadline=None)
@given(headers, st.binary(max_size=3000))
def test_encoding_equals_protobufs(header: pb.PutHeader | None, data: bytes) -> None:
    encoded = encode_put_chunk(header, memoryview(data))
    assert pb.PutChunk.FromString(encoded) == pb.PutChunk(header=header, data=data)
    decoded = decode_put_chunk(encoded)
    assert bytes(decoded.data) == data
    assert (decoded.header or pb.PutHeader()) == (header or pb.PutHeader())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_like_protobuf_or_fail_cleanly(raw: bytes) -> None:
    try:
        expected = pb.PutChunk.FromString(raw)
    except DecodeError:
        expected = None
    try:
        decoded = decode_put_chunk(raw)
    except (InvalidArgumentError, DecodeError):
        assert expected is None, "protobuf parsed what the hand decoder refused"
        return
    assert expected is not None, "the hand decoder parsed what protobuf refused"
    assert bytes(decoded.data) == expected.data
    assert (decoded.header or pb.PutHeader()) == expected.header


def test_a_truncated_field_is_refused() -> None:
    encoded = encode_put_chunk(None, memoryview(b"x" * 100))
    with pytest.raises(InvalidArgumentError, match="past the message"):
        decode_put_chunk(encoded[:-1])
