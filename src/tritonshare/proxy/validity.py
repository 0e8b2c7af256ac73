"""The validity period (notBefore, notAfter) of the first certificate of a PEM chain, read from its DER bytes
with the standard library (RFC 5280 §4.1: ``Certificate → TBSCertificate → [version], serialNumber, signature,
issuer, validity``). OpenSSL loads a certificate whatever its dates; :mod:`tritonshare.proxy.tls` reads them
here to refuse a rotation to an expired or not yet valid certificate and to export when the one in service
expires. A certificate this cannot read gives None: the dates are then not checked (never a refusal of a
certificate OpenSSL accepts).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import re
from typing import NamedTuple

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.+?)\s*-----END CERTIFICATE-----", re.DOTALL)
_SEQUENCE, _INTEGER, _VERSION = 0x30, 0x02, 0xA0
_UTC_TIME, _GENERALIZED_TIME = 0x17, 0x18
_TIME_FORMATS = {_UTC_TIME: "%y%m%d%H%M%SZ", _GENERALIZED_TIME: "%Y%m%d%H%M%SZ"}


class Validity(NamedTuple):
    not_before: float  # Unix seconds
    not_after: float

    def problem(self, now: float) -> str:
        """What is wrong with the certificate at ``now`` (Unix seconds): "" when it is valid."""
        if now > self.not_after:
            return f"expired at {_shown(self.not_after)}"
        if now < self.not_before:
            return f"is not valid before {_shown(self.not_before)}"
        return ""


def validity_of(pem: bytes) -> Validity | None:
    """The validity of the first certificate in ``pem``; None when there is none or it cannot be read."""
    match = _PEM.search(pem)
    if match is None:
        return None
    try:
        der = base64.b64decode(match[1], validate=False)
        return _validity(der)
    except (binascii.Error, ValueError, IndexError):
        return None


def _validity(der: bytes) -> Validity | None:
    tag, start, _ = _element(der, 0)  # Certificate
    if tag != _SEQUENCE:
        return None
    tag, pos, _ = _element(der, start)  # TBSCertificate: its fields follow
    if tag != _SEQUENCE:
        return None
    tag, _, end = _element(der, pos)
    if tag == _VERSION:  # [0] EXPLICIT version, absent in v1 certificates
        tag, _, end = _element(der, end)
    if tag != _INTEGER:  # serialNumber
        return None
    for _ in range(2):  # signature AlgorithmIdentifier, issuer Name
        tag, _, end = _element(der, end)
        if tag != _SEQUENCE:
            return None
    tag, pos, _ = _element(der, end)  # Validity
    if tag != _SEQUENCE:
        return None
    not_before, pos = _time(der, pos)
    not_after, _ = _time(der, pos)
    return Validity(not_before, not_after)


def _element(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of its contents, end of it) of the DER element at ``pos`` (one-byte tags, definite lengths)."""
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        count = length & 0x7F
        if not 0 < count <= 4:
            raise ValueError("DER length not of 1 to 4 bytes")
        length = int.from_bytes(der[pos : pos + count], "big")
        pos += count
    if pos + length > len(der):
        raise ValueError("DER element longer than the certificate")
    return tag, pos, pos + length


def _time(der: bytes, pos: int) -> tuple[float, int]:
    tag, start, end = _element(der, pos)
    form = _TIME_FORMATS.get(tag)
    if form is None:
        raise ValueError(f"DER tag {tag:#x} is not a time")
    text = der[start:end].decode("ascii")
    when = datetime.datetime.strptime(text, form)
    if tag == _UTC_TIME:  # two-digit years: 50-99 are 19xx (RFC 5280 §4.1.2.5.1), strptime puts 50-68 in 20xx
        year = int(text[:2])
        when = when.replace(year=(1900 if year >= 50 else 2000) + year)
    return when.replace(tzinfo=datetime.timezone.utc).timestamp(), end


def _shown(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
