"""HTTP/2 framing helpers of the gRPC relay (RFC 7540 §4, §6). Pure logic: no servers."""

from __future__ import annotations

import struct

import pytest

from tritonshare.proxy import http2


def test_frame_header_round_trip_masks_the_reserved_bit() -> None:
    frame = http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 0x7FFF_FFFF, b"x" * 70_000)
    assert http2.parse_header(frame, 0) == (70_000, http2.HEADERS, 0x5, 0x7FFF_FFFF)
    reserved = bytearray(frame)
    reserved[5] |= 0x80  # the R bit must be ignored when reading (§4.1)
    assert http2.parse_header(reserved, 0)[3] == 0x7FFF_FFFF


def test_parse_header_reads_at_an_offset() -> None:
    buf = b"junk" + http2.rst_stream(7, http2.CANCEL)
    assert http2.parse_header(buf, 4) == (4, http2.RST_STREAM, 0, 7)
    assert struct.unpack(">L", buf[4 + 9 :])[0] == http2.CANCEL


def test_window_update_splits_increments_beyond_the_31_bit_maximum() -> None:
    frames = http2.window_update(0, http2.MAX_WINDOW_INCREMENT + 5)
    first, second = frames[:13], frames[13:]
    assert http2.window_increment(first[9:]) == http2.MAX_WINDOW_INCREMENT
    assert http2.window_increment(second[9:]) == 5
    assert http2.window_update(3, 0) == b""


def test_goaway_carries_last_stream_and_code() -> None:
    frame = http2.goaway(41, http2.PROTOCOL_ERROR)
    assert http2.parse_header(frame, 0) == (8, http2.GOAWAY, 0, 0)
    assert http2.goaway_last_stream(frame[9:]) == 41
    assert struct.unpack(">L", frame[13:])[0] == http2.PROTOCOL_ERROR


def test_header_block_fragment_strips_padding_and_priority() -> None:
    block = b"\x82\x86\x84"
    padded = bytes([4]) + b"\x00\x00\x00\x03\x10" + block + b"\x00" * 4
    fragment = http2.header_block_fragment(http2.PADDED | http2.PRIORITY_FLAG, padded)
    assert bytes(fragment) == block
    assert bytes(http2.header_block_fragment(0, block)) == block


def test_header_block_fragment_refuses_padding_longer_than_the_frame() -> None:
    with pytest.raises(http2.FrameError, match="padding"):
        http2.header_block_fragment(http2.PADDED, bytes([9]) + b"abc")


def test_data_content_of_padded_and_plain_frames() -> None:
    assert http2.data_content(0, b"hello") == (0, 5)
    assert http2.data_content(http2.PADDED, b"\x02hello\x00\x00") == (1, 6)
    with pytest.raises(http2.FrameError):
        http2.data_content(http2.PADDED, b"\x09abc")


def test_header_frames_split_large_blocks_into_continuations() -> None:
    block = bytes(range(256)) * 100  # 25,600 bytes: one HEADERS and one CONTINUATION at 16 KiB
    frames = http2.header_frames(5, block, end_stream=True)
    first = http2.parse_header(frames, 0)
    assert first == (16_384, http2.HEADERS, http2.END_STREAM, 5)
    second = http2.parse_header(frames, 9 + 16_384)
    assert second == (len(block) - 16_384, http2.CONTINUATION, http2.END_HEADERS, 5)
    assert frames[9 : 9 + 16_384] + frames[18 + 16_384 :] == block


def test_header_frames_of_a_small_block_is_one_headers_frame() -> None:
    frames = http2.header_frames(1, b"\x88", end_stream=False)
    assert http2.parse_header(frames, 0) == (1, http2.HEADERS, http2.END_HEADERS, 1)


def test_settings_frame_and_ack() -> None:
    frame = http2.settings({0x3: 100})
    assert http2.parse_header(frame, 0) == (6, http2.SETTINGS, 0, 0)
    assert frame[9:] == b"\x00\x03\x00\x00\x00\x64"
    assert http2.parse_header(http2.SETTINGS_ACK, 0) == (0, http2.SETTINGS, http2.ACK, 0)


def test_settings_pairs_read_what_settings_writes_and_refuse_a_torn_payload() -> None:
    frame = http2.settings({http2.SETTINGS_MAX_FRAME_SIZE: 1 << 22, http2.SETTINGS_MAX_CONCURRENT_STREAMS: 100})
    assert http2.settings_pairs(frame[9:]) == {http2.SETTINGS_MAX_FRAME_SIZE: 1 << 22, 3: 100}
    with pytest.raises(http2.FrameError) as info:
        http2.settings_pairs(frame[9:-1])
    assert info.value.code == http2.FRAME_SIZE_ERROR
