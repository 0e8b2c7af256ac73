"""HPACK decoding in step with a client's encoder, and encoding that never touches a table (RFC 7541).

The reference is the ``hpack`` package's own Decoder: both must read the same headers from the same
bytes, block after block, whatever the encoder indexed, Huffman-coded or evicted.
"""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonshare.proxy.hpack_codec import HeaderDecoder, HpackError, changes_table, encode_plain

_NAMES = st.sampled_from([b":path", b":authority", b"content-type", b"grpc-timeout", b"x-tenant", b"te"])
_VALUES = st.binary(min_size=0, max_size=40)
_BLOCK = st.lists(st.tuples(_NAMES, _VALUES, st.booleans()), min_size=1, max_size=8)


def _encode(encoder: hpack.Encoder, headers: list[tuple[bytes, bytes, bool]], huffman: bool) -> bytes:
    fields = [hpack.NeverIndexedHeaderTuple(n, v) if never else (n, v) for n, v, never in headers]
    return bytes(encoder.encode(fields, huffman=huffman))


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.lists(_BLOCK, min_size=1, max_size=12), huffman=st.booleans(), table_size=st.sampled_from([64, 256, 4096])
)
def test_decodes_what_the_reference_decodes_block_after_block(
    blocks: list[list[tuple[bytes, bytes, bool]]], huffman: bool, table_size: int
) -> None:
    encoder, reference, ours = hpack.Encoder(), hpack.Decoder(), HeaderDecoder()
    encoder.header_table_size = table_size  # the next block starts with a size update: ours must follow it
    for headers in blocks:
        block = _encode(encoder, headers, huffman)
        expected = [(bytes(n), bytes(v)) for n, v in reference.decode(block, raw=True)]
        assert list(ours.decode(block).headers) == expected


def test_an_all_indexed_block_is_cached_until_the_table_changes() -> None:
    encoder, ours = hpack.Encoder(), HeaderDecoder()
    first = bytes(encoder.encode([(b":path", b"/a")]))  # inserts :path /a at index 62
    assert ours.decode(first).changes_table
    indexed = bytes(encoder.encode([(b":path", b"/a")]))
    assert indexed == b"\xbe"
    assert ours.decode(indexed).get(b":path") == b"/a"
    assert not ours.decode(indexed).changes_table
    ours.decode(bytes(encoder.encode([(b":path", b"/b")])))  # now /b is index 62
    assert ours.decode(b"\xbe").get(b":path") == b"/b"  # the same bytes mean something else now


def test_blocks_of_unique_large_strings_do_not_fill_the_caches() -> None:
    # one connection's HEADERS to an unknown path, each with a never-indexed 36 KiB Huffman literal of its own:
    # cached by their bytes, 1010 of them pinned ~105 MiB
    encoder, ours = hpack.Encoder(), HeaderDecoder()
    for i in range(60):
        value = (b"%06d" % i) * 700
        block = bytes(encoder.encode([(b":path", b"/x/unknown"), (b"x-pad", value, True)], huffman=True))
        assert ours.decode(block).get(b"x-pad") == value
    kept = sum(len(raw) + len(text) for raw, text in ours._huffman.items())
    kept += sum(len(block) + sum(len(n) + len(v) for n, v in decoded.headers) for block, decoded in ours.known.items())
    assert kept < 100 << 10
    headers = [(b":path", b"/x/unknown"), (b"te", b"trailers")]
    ours.decode(bytes(encoder.encode(headers, huffman=True)))  # indexes them
    repeated = bytes(encoder.encode(headers, huffman=True))  # all indexed now: short, and cached
    assert ours.decode(repeated) is ours.decode(repeated)


def test_entries_larger_than_the_table_empty_it() -> None:
    ours = HeaderDecoder(max_table_size=64)
    ours.decode(b"\x40\x01a\x01b")  # 34 bytes: fits
    assert ours.decode(b"\xbe").get(b"a") == b"b"
    ours.decode(b"\x40\x01c" + bytes([40]) + b"x" * 40)  # 73 bytes > 64: table emptied, nothing added
    with pytest.raises(HpackError, match="out of range"):
        ours.decode(b"\xbe")


def test_a_size_update_evicts_and_counts_as_a_change() -> None:
    ours = HeaderDecoder()
    ours.decode(b"\x40\x01a\x01b")
    block = ours.decode(b"\x20")  # size 0: everything evicted
    assert block.changes_table and block.headers == ()
    with pytest.raises(HpackError):
        ours.decode(b"\xbe")


@pytest.mark.parametrize(
    "block",
    [
        b"\x40\x05:pa",  # string runs past the block
        b"\x80",  # index 0 is invalid
        b"\xff\xff\xff\xff\xff\xff\x7f",  # integer far too large
        b"\x40\x81\xff\x00",  # Huffman string with an EOS-like padding error
    ],
)
def test_invalid_blocks_raise_hpack_error(block: bytes) -> None:
    with pytest.raises(HpackError):
        HeaderDecoder().decode(block)


def test_changes_table_reads_structure_only() -> None:
    encoder = hpack.Encoder()
    inserting = bytes(encoder.encode([(b"grpc-status", b"0")]))
    assert changes_table(inserting)
    assert not changes_table(bytes(encoder.encode([(b"grpc-status", b"0")])))  # now an indexed reference
    assert not changes_table(encode_plain([(b"grpc-status", b"5"), (b"x-long", b"v" * 300)]))
    assert changes_table(b"\x3f\xe1\x1f")  # size update to 4096
    assert changes_table(b"\x00\x05ab")  # malformed: treated as changing (it cannot be dropped safely)


def test_encode_plain_round_trips_and_leaves_the_table_alone() -> None:
    headers = [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-message", b"x" * 200)]
    reference = hpack.Decoder()
    block = encode_plain(headers)
    assert [(bytes(n), bytes(v)) for n, v in reference.decode(block, raw=True)] == headers
    assert len(reference.header_table.dynamic_entries) == 0
    assert block[0] == 0x88  # :status 200 is static entry 8
    assert not changes_table(block)


def test_path_and_encoding_are_read_once_and_repeats_are_flagged() -> None:
    encoder, ours = hpack.Encoder(), HeaderDecoder()
    single = ours.decode(bytes(encoder.encode([(b":path", b"/a"), (b"grpc-encoding", b"gzip")])))
    assert (single.path, single.encoding, single.ambiguous) == (b"/a", b"gzip", False)
    assert ours.decode(bytes(encoder.encode([(b":path", b"/a"), (b":path", b"/b")]))).ambiguous
    assert ours.decode(bytes(encoder.encode([(b"grpc-encoding", b"gzip"), (b"grpc-encoding", b"x")]))).ambiguous
    assert ours.decode(bytes(encoder.encode([(b"te", b"trailers")]))).path is None


def test_authorization_is_read_and_a_repeat_is_flagged_whatever_comes_between() -> None:
    encoder, ours = hpack.Encoder(), HeaderDecoder()
    once = ours.decode(bytes(encoder.encode([(b":path", b"/a"), (b"authorization", b"Bearer t")])))
    assert (once.authorization, once.repeated_authorization, once.ambiguous) == (b"Bearer t", False, False)
    fields = [(b"authorization", b"Bearer t"), (b":path", b"/a"), (b"authorization", b"Bearer u")]
    twice = ours.decode(bytes(encoder.encode(fields)))
    assert (twice.authorization, twice.repeated_authorization, twice.ambiguous) == (b"Bearer t", True, False)
    assert ours.decode(bytes(encoder.encode([(b":path", b"/a")]))).authorization is None
