"""HPACK (RFC 7541) for the gRPC relay: a decoder that mirrors the client's encoder table, and an encoder
that never touches the peer's table.

The relay forwards the client's header blocks to Triton as they are, so Triton's decoder and this one see
the same bytes and keep identical dynamic tables (REFERENCE §6). This decoder exists to read ``:path``
(and ``grpc-encoding``): it keeps the table and decodes every block in order, Huffman strings with the
``hpack`` package's table. Blocks that leave the table unchanged decode to the same headers every time
they recur, so they are cached by their bytes until the next table change — a gRPC client repeats the
same all-indexed block for every call of a method.

:func:`encode_plain` writes static-table references and never-indexed literals only: what the relay
sends when it answers a client itself, and what it sends Triton once a dropped header block has put the
two tables out of step (re-encode mode). :func:`changes_table` tells, without a table, whether a block
would change the receiver's table (so whether it may be dropped).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hpack.exceptions import HPACKDecodingError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

Header = tuple[bytes, bytes]
Buffer = bytes | memoryview

STATIC_TABLE: tuple[Header, ...] = HeaderTable.STATIC_TABLE
_STATIC_COUNT = len(STATIC_TABLE)
_STATIC_PAIRS: dict[Header, int] = {}
_STATIC_NAMES: dict[bytes, int] = {}
for _index, (_name, _value) in enumerate(STATIC_TABLE, start=1):
    _STATIC_PAIRS.setdefault((_name, _value), _index)
    _STATIC_NAMES.setdefault(_name, _index)

DEFAULT_TABLE_SIZE = 4096  # SETTINGS_HEADER_TABLE_SIZE's initial value (RFC 7540 §6.5.2)
# The largest dynamic table a client may ask for with a size update. RFC 7541 §6.3 bounds it by the decoder's
# SETTINGS_HEADER_TABLE_SIZE, which the relay does not read from Triton's SETTINGS (grpc-core keeps 4096);
# this ceiling bounds the memory a client can make the proxy hold per connection, for blocks Triton never
# sees (refused streams).
MAX_TABLE_SIZE = 64 * 1024
_ENTRY_OVERHEAD = 32  # RFC 7541 §4.1
# Decoded blocks and Huffman strings are cached by their bytes (a client repeats them call after call), but
# only short ones, which the repeated ones are: caching any size let one connection pin ~105 MiB with blocks of
# unique 36 KiB strings on refused streams. Bounded so, the caches hold < 100 KiB per connection.
_CACHE_LIMIT = 128
_CACHED_BLOCK_BYTES = 256
_HUFFMAN_CACHE_LIMIT = 256
_CACHED_STRING_BYTES = 64
_MAX_INTEGER_SHIFT = 28  # integers beyond 2**28 are no header a peer needs; refuse them


class HpackError(Exception):
    """A header block that cannot be decoded: the connection's compression state is lost."""


# The fields a header block is read for, each counted in the one pass over its headers (:meth:`HeaderBlock.of`).
_READ = frozenset({b":path", b"grpc-encoding", b"grpc-status", b"authorization", b"grpc-timeout"})


@dataclass(frozen=True, slots=True)
class HeaderBlock:
    headers: tuple[Header, ...]
    changes_table: bool  # decoding it inserted entries or resized the table
    path: bytes | None  # what the relay judges, read once per distinct block
    encoding: bytes | None  # grpc-encoding
    ambiguous: bool  # :path or grpc-encoding given more than once: readers might disagree on which counts
    status: bytes | None  # grpc-status (of a response's trailers), read once per distinct block
    authorization: bytes | None  # the bearer token's header (the first, if repeated)
    repeated_authorization: bool  # authorization given more than once: the proxy and Triton might read either
    deadline: bool  # grpc-timeout given: Triton's gRPC server would cancel the call when it passes

    @classmethod
    def of(cls, headers: tuple[Header, ...], changes_table: bool) -> HeaderBlock:
        """The block with the fields the proxy reads, found in one pass over its headers."""
        found: dict[bytes, list[bytes]] = {}
        for name, value in headers:
            if name in _READ:
                found.setdefault(name, []).append(value)
        paths = found.get(b":path", ())
        encodings = found.get(b"grpc-encoding", ())
        statuses = found.get(b"grpc-status", ())
        tokens = found.get(b"authorization", ())
        return cls(
            headers,
            changes_table,
            paths[0] if paths else None,
            encodings[0] if encodings else None,
            len(paths) > 1 or len(encodings) > 1,
            statuses[0] if statuses else None,
            tokens[0] if tokens else None,
            len(tokens) > 1,
            b"grpc-timeout" in found,
        )

    def get(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class HeaderDecoder:
    """Decodes one direction's header blocks in order, keeping the dynamic table in step.

    :attr:`known` holds the blocks seen since the table last changed that did not change it, by their bytes:
    a hit there is what :meth:`decode` would return (hot paths look there first, saving a call). It is one
    dict for the decoder's life, emptied when the table changes.
    """

    def __init__(self, max_table_size: int = DEFAULT_TABLE_SIZE) -> None:
        self._table: deque[Header] = deque()  # newest first: dynamic index 62 is self._table[0]
        self._size = 0
        self._max_size = max_table_size
        self.known: dict[bytes, HeaderBlock] = {}
        self.changes = 0  # blocks that changed the table so far: while it stays, known bytes decode as they did
        self._huffman: dict[bytes, bytes] = {}

    def decode(self, block: bytes) -> HeaderBlock:
        cached = self.known.get(block)
        if cached is not None:
            return cached
        try:
            result = self._decode(block)
        except IndexError as short:  # (one name per clause: compiled code types a name once, by its first use)
            raise HpackError("header block ends inside a field") from short
        except HPACKDecodingError as invalid:
            raise HpackError(f"invalid Huffman string in header block: {invalid}") from invalid
        if result.changes_table:
            self.known.clear()
            self.changes += 1
        elif len(block) <= _CACHED_BLOCK_BYTES:
            if len(self.known) >= _CACHE_LIMIT:
                self.known.clear()
            self.known[block] = result
        return result

    def _decode(self, block: bytes) -> HeaderBlock:
        headers: list[Header] = []
        changed = False
        pos, end = 0, len(block)
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                headers.append(self._entry(index))
            elif first & 0x40:  # literal with incremental indexing
                header, pos = self._literal(block, pos, 6)
                self._insert(header)
                headers.append(header)
                changed = True
            elif first & 0x20:  # dynamic table size update
                size, pos = _integer(block, pos, 5)
                self._resize(size)
                changed = True
            else:  # literal without indexing (0x00) or never indexed (0x10)
                header, pos = self._literal(block, pos, 4)
                headers.append(header)
        return HeaderBlock.of(tuple(headers), changed)

    def _literal(self, block: bytes, pos: int, prefix_bits: int) -> tuple[Header, int]:
        index, pos = _integer(block, pos, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = self._string(block, pos)
        value, pos = self._string(block, pos)
        return (name, value), pos

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        huffman = block[pos] & 0x80
        length, pos = _integer(block, pos, 7)
        end = pos + length
        if end > len(block):
            raise HpackError("header block ends inside a string")
        raw = block[pos:end]
        if not huffman:
            return raw, end
        text = self._huffman.get(raw)
        if text is None:
            text = decode_huffman(raw)
            if length <= _CACHED_STRING_BYTES:
                if len(self._huffman) >= _HUFFMAN_CACHE_LIMIT:
                    self._huffman.clear()
                self._huffman[raw] = text
        return text, end

    def _entry(self, index: int) -> Header:
        if 0 < index <= _STATIC_COUNT:
            return STATIC_TABLE[index - 1]
        dynamic = index - _STATIC_COUNT - 1
        if index == 0 or dynamic >= len(self._table):
            raise HpackError(f"header table index {index} is out of range")
        return self._table[dynamic]

    def _insert(self, header: Header) -> None:
        size = len(header[0]) + len(header[1]) + _ENTRY_OVERHEAD
        if size > self._max_size:  # an entry larger than the table empties it (RFC 7541 §4.4)
            self._table.clear()
            self._size = 0
            return
        self._table.appendleft(header)
        self._size += size
        self._evict()

    def _resize(self, size: int) -> None:
        if size > MAX_TABLE_SIZE:
            raise HpackError(f"dynamic table size update to {size} bytes exceeds the limit of {MAX_TABLE_SIZE}")
        self._max_size = size
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max_size:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + _ENTRY_OVERHEAD


def _integer(block: Buffer, pos: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer (RFC 7541 §5.1) whose prefix starts at ``block[pos]``; returns (value, next pos)."""
    mask = (1 << prefix_bits) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > _MAX_INTEGER_SHIFT:
            raise HpackError("header block integer is too large")


def changes_table(block: Buffer) -> bool:
    """Would decoding ``block`` change the receiver's dynamic table? Reads only the representations'
    structure, so it needs no table; a malformed block counts as changing it (it cannot be dropped)."""
    pos, end = 0, len(block)
    try:
        while pos < end:
            first = block[pos]
            if first & 0xC0 == 0x40 or first & 0xE0 == 0x20:
                return True
            if first & 0x80:
                pos = _integer(block, pos, 7)[1]
                continue
            index, pos = _integer(block, pos, 4)
            if not index:
                pos = _skip_string(block, pos)
            pos = _skip_string(block, pos)
    except (IndexError, HpackError):
        return True
    return pos != end


def _skip_string(block: Buffer, pos: int) -> int:
    length, pos = _integer(block, pos, 7)
    return pos + length


def encode_plain(headers: tuple[Header, ...] | list[Header]) -> bytes:
    """A header block of static-table references and never-indexed literals: it changes no table, so
    the receiver's dynamic table stays exactly as it was. No Huffman coding: simple over small."""
    out = bytearray()
    for name, value in headers:
        index = _STATIC_PAIRS.get((name, value))
        if index is not None:
            out += _encode_integer(index, 7, 0x80)
            continue
        name_index = _STATIC_NAMES.get(name, 0)
        out += _encode_integer(name_index, 4, 0x10)
        if not name_index:
            out += _encode_integer(len(name), 7, 0x00) + name
        out += _encode_integer(len(value), 7, 0x00) + value
    return bytes(out)


def _encode_integer(value: int, prefix_bits: int, pattern: int) -> bytes:
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes((pattern | value,))
    out = bytearray((pattern | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
