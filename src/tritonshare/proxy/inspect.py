"""The checks of an inference request's JSON: it must not name a shared-memory parameter (REFERENCE §3), nest
deeper than Triton's parser survives, declare input shapes its body cannot carry, or ask for classification.

Shared-memory parameters (``shared_memory_region`` ...) make Triton read inputs from, or write outputs to, a
region registered by whoever registered it — another tenant's memory. The proxy refuses any request whose
JSON carries one of those keys, anywhere: request parameters, input or output parameters, or any other object
(a conservative rule: it checks every key of every JSON object, duplicates included).

What the JSON is, read the way Triton reads it (``http_server.cc``):

- the body is decoded first when ``Content-Encoding`` is gzip or deflate (Triton inflates both with zlib's
  automatic header detection, ``inflateInit2(15 | 32)``, and stops at the end of the first stream);
- infer: with the binary-tensor extension, the JSON is the first ``Inference-Header-Content-Length`` bytes of
  the decoded body; ``0`` means a raw binary body (no JSON at all); without the header, the whole body;
- generate / generate_stream: the whole body (the header is ignored by Triton there).

An infer request's input shapes must not declare more elements than its body can carry (:func:`check_shapes`):
Triton allocates what a shape declares before it reads the data, and aborts when that is too much. Nor may it
name the ``classification`` parameter (:func:`check_classification`): Triton dies classifying a BYTES output.

The fast path: JSON that contains neither ``shared_memory_`` nor a backslash cannot spell such a key, so it is
not looked at further; else one scan of its string tokens finds the keys (:func:`check_json`), in bounded memory.
How a body reaches these checks (held, inflated, re-framed) is :mod:`tritonshare.proxy.request_body`'s.
"""

from __future__ import annotations

import json
import re

from tritonshare.common.errors import clip
from tritonshare.proxy.policy import CLASSIFICATION, CLASSIFICATION_REFUSAL, SHM_MARKER, SHM_PARAMETERS


class BodyRefused(Exception):
    """The body may not be forwarded; the proxy answers ``status`` itself."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


ESCAPE = b"\\"  # a JSON string escape starts with it


def might_name_shm(part: bytes) -> bool:
    """False when this JSON cannot name a shared-memory parameter: it has neither the marker nor a backslash
    (a ``\\u`` escape could spell the marker; any escape sends the body to the full check, which is rare in
    infer requests and only slower).

    Per request, so written for CPython's cost (callgrind, 3.11): ``partition`` takes one argument and, when
    nothing is found, returns ``part`` itself (~850 instructions); ``find`` parses its arguments as a tuple
    (~1,350), and ``in`` first tries the operand as an integer, raising and clearing a TypeError (~2,500). A
    one-byte separator is a ``memchr``: a third of the time of looking for ``\\u``."""
    return bool(part.partition(SHM_MARKER)[1] or part.partition(ESCAPE)[1])


def check_json(part: bytes) -> None:
    """Raise :class:`BodyRefused` if this JSON nests deeper than :data:`MAX_DEPTH` (:func:`check_depth`) or
    names a shared-memory parameter as a key, at any depth.

    The keys are found the way a JSON parser meets them, without building the document (``json.loads`` of a
    48 MB body peaks at 15 times its size and blocks the event loop for seconds): one scan of the string
    tokens in order from the start (:data:`_SCAN`), so a quote inside a string, escaped, never starts one; a
    string followed by ``:`` is a key — in valid JSON, exactly the keys rapidjson (Triton) reads, at any
    depth, duplicates included. The scan stops only at a key that spells a parameter's name, each character
    as itself or as its ``\\u`` escape (no other spelling decodes to it), or at a quote never closed (refused
    as unreadable). Other invalid JSON goes on to Triton, which refuses it."""
    if might_name_shm(part):
        _check_keys(part)
    check_depth(part)


def _check_keys(part: bytes) -> None:
    """The scan of the string tokens for a shared-memory key (see :func:`check_json`)."""
    found = _SCAN.match(part)
    if found is None:  # not expected: the scan stops at the end at the latest
        raise BodyRefused(400, "the request's JSON cannot be read", "bad_json")
    if found[1] is not None:
        name = json.loads(b'"' + found[1] + b'"')
        raise BodyRefused(
            400,
            f"shared-memory parameter {name!r} is not allowed through this proxy; send tensor data in the "
            "request (JSON or binary) instead",
            "shared_memory",
        )
    if found.end() < len(part):
        raise BodyRefused(
            400, f"the request's JSON cannot be parsed: a string at byte {found.end() - 1} is never closed", "bad_json"
        )


# Triton parses JSON with rapidjson's recursive parser: nesting 50,000 deep crashed Triton 2.51 here (20,000
# did not) — every tenant's server, from one request. Inference JSON nests a few levels (objects, then one
# array level per tensor dimension); 128 is far above what a request needs and far below the crash.
MAX_DEPTH = 128
# every byte → deleted, but for '"', and the brackets, as '[' and ']' (objects nest like arrays)
_STRUCTURE = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_STRING_CONTENTS = re.compile(rb'"[^"]*"')  # once escapes and all else are gone: a string's brackets
_OPEN_RUN, _CLOSE_RUN = b"[" * (MAX_DEPTH + 1), b"]" * (MAX_DEPTH + 1)
DEPTH_WORK_BYTES = 256 << 20  # brackets scanned by the passes, at most (~0.2 s); a nested tensor takes a few MB


def check_depth(part: bytes) -> None:
    """Raise :class:`BodyRefused` when this JSON may nest deeper than :data:`MAX_DEPTH`, without a parser,
    all in C-speed bytes operations: the brackets outside strings are kept, then matched pairs are removed a
    nesting level per pass. After p passes the depth is at most p plus the brackets left (each encloses a
    point once), so the passes stop as soon as that is within the limit — at once for most requests, after a
    few for nested tensors (a level per dimension). A run of more than MAX_DEPTH brackets is refused at once
    (the deep chain, which would take a pass per level); so is a remainder of unmatched brackets over the
    limit (invalid JSON); and so is a body whose passes would scan more than :data:`DEPTH_WORK_BYTES` (megabytes
    of brackets nested a hundred levels deep: no tensor looks like that, and checking it would hold the event
    loop for seconds — 22 s for 60 MB before this bound)."""
    if ESCAPE in part:  # an escaped backslash, then an escaped quote, must not end or start a string (a copy)
        part = part.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = part.translate(_STRUCTURE, _NOT_STRUCTURE).replace(b'""', b"")  # strings without brackets go
    if b'"' in structure:  # (two quotes side by side either end a string and open the next, or close an empty one)
        structure = _STRING_CONTENTS.sub(b"", structure)
    passes = work = 0
    while len(structure) + passes > MAX_DEPTH:
        work += len(structure)
        inner = structure.replace(b"[]", b"")
        if len(inner) == len(structure) or passes >= MAX_DEPTH or (passes < 2 and _long_run(structure)):
            raise BodyRefused(
                400,
                f"the request's JSON nests deeper than {MAX_DEPTH} levels (or leaves brackets unmatched): "
                "Triton's parser recurses per level — send the tensor flat, with its shape",
                "too_deep",
            )
        if work > DEPTH_WORK_BYTES:
            raise BodyRefused(
                400,
                f"the request's JSON nests {len(structure) // 1024} KiB of brackets more than {passes} levels "
                "deep: too costly to check — send the tensor flat, with its shape",
                "too_deep",
            )
        structure, passes = inner, passes + 1


def _long_run(structure: bytes) -> bool:
    """More than MAX_DEPTH brackets in a row: a chain (before the first pass) or a comb (after it) that would
    take a pass per level. Looked for in the first two passes only: each look is a scan of its own."""
    return _OPEN_RUN in structure or _CLOSE_RUN in structure


def _spelled(name: str) -> bytes:
    """A pattern of the JSON string contents that decode to ``name`` (ASCII, no quote or backslash)."""
    units = []
    for char in name:
        code = b"".join(b"[%s%s]" % (d.lower(), d.upper()) if d.isalpha() else d for d in _hex(ord(char)))
        units.append(b"(?:" + re.escape(char.encode()) + rb"|\\u" + code + b")")
    return b"".join(units)


def _hex(code: int) -> list[bytes]:
    return [bytes([d]) for d in b"%04x" % code]


_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'  # a JSON string token, quotes included (any escape skipped whole)
_SHM_NAME = b"|".join(_spelled(name) for name in sorted(SHM_PARAMETERS))
_COLON = rb"[ \t\n\r]*+:"
# From the start: non-quote runs and whole strings other than a shared-memory key, possessively (linear time),
# then whichever comes first: such a key (group 1: its contents), a quote never closed, or the end.
_SCAN = re.compile(
    rb'(?:[^"]++|(?!"(?:' + _SHM_NAME + b')"' + _COLON + b")" + _STRING + b")*+"
    rb'(?:"(' + _SHM_NAME + b')"' + _COLON + rb'|"|\Z)',
    re.DOTALL,
)


# Triton's REST front end sizes an input's buffer from its declared shape before it reads the JSON "data"
# (``http_server.cc``: ``serialized.resize(element_cnt * dtype size)``, the data checked after): one small request
# declaring 10**12 elements made Triton 2.51 abort on std::bad_alloc, and 2**63-1 (a size wrapped past
# vector::max_size) on std::length_error — every tenant's server, here. A valid request carries at least a byte per
# element (a JSON number, or binary tensor bytes), so no input declares more elements than the body has bytes (or
# SHAPE_FLOOR, whatever the body: Triton allocates at most 8 MiB for those); a shape array of at most
# _QUICK_SHAPE_DIGITS digits declares fewer, and is not parsed.
SHAPE_KEY = b'"shape"'
SHAPE_FLOOR = 1 << 20
_QUICK_SHAPE_DIGITS = len(str(SHAPE_FLOOR)) - 1  # (6: fewer than 10**6 elements)
_NOT_DIGITS = bytes(b for b in range(256) if not 0x30 <= b <= 0x39)  # deleted, they leave a shape's digits
_BLANKS = b" \t\n\r"
_ARRAY = rb"[ \t\n\r]*+:[ \t\n\r]*+\[([0-9, \t\n\r]*+)\]"  # a key's array of unsigned integers (Triton's dims)
_SHAPE_ARRAY = re.compile(_ARRAY)  # from just after the key
_SPELLED_SHAPE = re.compile(b'"' + _spelled("shape") + b'"' + _ARRAY)  # any spelling of the key, escapes included
# The key, then an array holding more than _QUICK_SHAPE_DIGITS digits (among commas and blanks: what _ARRAY reads).
# Each try stops at the first byte that is not of the array, so the search is linear: a try that ran on to the
# next ']' over any byte, as this did first, read a body of repeated keys once per key (224 KB: 29 s).
# The digits are spelled out, not repeated by a count ({7}): sre's counted repeat costs ~400 instructions a
# request more (callgrind, the yardstick's request: ~3,050 against ~3,450).
_LONG_SHAPE = re.compile(
    SHAPE_KEY + rb"[ \t\n\r]*+:[ \t\n\r]*+\[" + rb"[, \t\n\r]*+[0-9]" * (_QUICK_SHAPE_DIGITS + 1)
).search
_MAX_DIM_DIGITS = 20  # uint64: a longer number is no dim Triton takes (and may be huge: not converted)
TOO_MANY = 1 << 64  # element counts saturate here (a later 0 still makes them 0)


def long_shapes(data: bytes, pos: int = 0) -> bool:
    """Whether ``data[pos:]`` (JSON without escapes) may declare more than :data:`SHAPE_FLOOR` elements for an
    input: a ``"shape"`` key whose array holds more than :data:`_QUICK_SHAPE_DIGITS` digits (then
    :func:`check_shapes`, which reads arrays as this does, decides). The short path's test: one search, ~3,050
    instructions for the benchmark's request (a find of the key and a match at each: ~5,400)."""
    return _LONG_SHAPE(data, pos) is not None


def check_shapes(part: bytes, carried: int, *, exact: bool = True) -> None:
    """Raise :class:`BodyRefused` when an input's shape in this infer JSON declares more elements than a body of
    ``carried`` decoded bytes (or :data:`SHAPE_FLOOR`) can hold. Every ``"shape"`` key counts, wherever it is.

    ``exact``: the body is ``carried`` bytes. When it is only at most that (chunked, or compressed), a shape
    larger than the JSON part itself must be of an input whose data is binary: an object with a ``"data"`` key
    (which Triton sizes from the shape) may declare no more elements than the JSON part has bytes
    (:func:`_check_inline_data`)."""
    if ESCAPE in part:
        arrays = [match[1] for match in _SPELLED_SHAPE.finditer(part)]
    else:
        arrays = []
        pos = part.find(SHAPE_KEY)
        while pos >= 0:
            match = _SHAPE_ARRAY.match(part, pos + len(SHAPE_KEY))
            if match is not None:
                arrays.append(match[1])
            pos = part.find(SHAPE_KEY, pos + len(SHAPE_KEY))
    bound, inline = max(carried, SHAPE_FLOOR), max(len(part), SHAPE_FLOOR)
    beyond_part = False
    for dims in arrays:
        if len(dims.translate(None, _NOT_DIGITS)) <= _QUICK_SHAPE_DIGITS:
            continue
        count = _elements(dims)
        if count > bound:
            raise _oversized(clip(dims.decode("ascii"), 60), f"the body can carry ({carried} bytes)")
        beyond_part = beyond_part or count > inline
    if beyond_part and not exact:
        _check_inline_data(part, inline)


CLASSIFICATION_WORD = CLASSIFICATION.encode()
_SPELLED_CLASSIFICATION = re.compile(b'"' + _spelled(CLASSIFICATION) + b'"' + _COLON).search


def check_classification(part: bytes) -> None:
    """Raise :class:`BodyRefused` if this infer JSON has a ``classification`` key, in any spelling, anywhere (Triton
    reads it on outputs only, where it may kill the server: :data:`~tritonshare.proxy.policy.CLASSIFICATION_REFUSAL`;
    finding where a key is would take a parse). JSON with neither the word nor an escape is not searched further.
    A ``"classification":`` inside a string can be one only with its quotes escaped, which the pattern does not
    take for quotes."""
    if (part.partition(CLASSIFICATION_WORD)[1] or part.partition(ESCAPE)[1]) and _SPELLED_CLASSIFICATION(part):
        raise BodyRefused(400, CLASSIFICATION_REFUSAL, "classification")


_INLINE_PARSE_BYTES = 1 << 20  # a JSON part parsed to tell inline-data inputs from binary ones, at most


class _Oversized(Exception):
    """An object with inline data declares a shape larger than the JSON part (raised from the parser's hook)."""


def _check_inline_data(part: bytes, inline: int) -> None:
    """Refuse the JSON part if an object holding a ``"data"`` key has a ``"shape"`` (any of them: duplicates
    count, as rapidjson reads the first) of more than ``inline`` elements; or if it cannot be read so (too
    large, or not JSON to Python: it might be to rapidjson)."""
    if len(part) > _INLINE_PARSE_BYTES:
        raise _oversized("…", f"a JSON part this large ({len(part)} bytes, in a body of unknown length) is checked")

    def hook(pairs: list[tuple[str, object]]) -> None:  # objects are not kept: only their shapes are looked at
        if any(key == "data" for key, _ in pairs):
            for key, value in pairs:
                if key == "shape" and _count(value) > inline:
                    raise _Oversized(json.dumps(value))

    try:
        json.loads(part, object_pairs_hook=hook)
    except _Oversized as exc:
        raise _oversized(clip(str(exc)[1:-1], 60), f"its JSON data holds ({len(part)} bytes)") from None
    except ValueError:  # (json.JSONDecodeError, UnicodeDecodeError)
        raise BodyRefused(400, "the request's JSON cannot be read to check its input shapes", "bad_json") from None


def _count(value: object) -> int:
    """The element count of a parsed shape; 0 for what Triton does not take as one."""
    if not isinstance(value, list):
        return 0
    count = 1
    for dim in value:
        if type(dim) is not int or dim < 0:
            return 0
        count = min(count * dim, TOO_MANY)
    return count


def _oversized(shape: str, what: str) -> BodyRefused:
    return BodyRefused(
        400,
        f"an input's shape [{shape}] declares more elements than {what}: Triton would allocate them before "
        "reading the data",
        "shape",
    )


def _elements(dims: bytes) -> int:
    """The element count of a shape array's contents (digits, commas, blanks); one that is not a list of numbers
    (invalid JSON: Triton refuses it) counts 0, a number longer than any uint64 as too many."""
    count = 1
    for item in dims.split(b","):
        digits = item.strip(_BLANKS)
        if not digits or not digits.isdigit():
            return 0
        # (kept below 2**64 + 1: a zero later still makes it 0, and no product of many huge numbers is built)
        count = min(count * (int(digits) if len(digits) <= _MAX_DIM_DIGITS else TOO_MANY), TOO_MANY)
    return count
