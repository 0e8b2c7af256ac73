"""Reading a certificate's validity period from its PEM, checked against the ``cryptography`` package's reading."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509

from tests.support.certs import CertificateAuthority
from tritonshare.proxy.validity import Validity, validity_of

UTC = datetime.timezone.utc


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority()


@pytest.mark.parametrize(
    ("not_before", "not_after"),
    [
        (datetime.datetime(2024, 2, 29, 12, 30, 5, tzinfo=UTC), datetime.datetime(2025, 3, 1, tzinfo=UTC)),
        # UTCTime's two-digit years: 1950-1999 and 2000-2049 (RFC 5280); GeneralizedTime from 2050 on
        (datetime.datetime(1955, 1, 1, tzinfo=UTC), datetime.datetime(2049, 12, 31, 23, 59, 59, tzinfo=UTC)),
        (datetime.datetime(2030, 6, 1, tzinfo=UTC), datetime.datetime(2051, 6, 1, tzinfo=UTC)),
    ],
)
def test_dates_are_read_as_cryptography_reads_them(
    ca: CertificateAuthority, not_before: datetime.datetime, not_after: datetime.datetime
) -> None:
    pem, _ = ca.issue(serial=2**150 + 7, not_before=not_before, not_after=not_after)  # a long serial number too
    parsed = x509.load_pem_x509_certificate(pem)
    assert validity_of(pem) == (parsed.not_valid_before_utc.timestamp(), parsed.not_valid_after_utc.timestamp())
    assert validity_of(pem + ca.pem) == validity_of(pem)  # a chain: the first certificate's


@pytest.mark.parametrize(
    "pem",
    [
        b"",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        b"-----BEGIN CERTIFICATE-----\nMIIBIjANBgkqhkiG9w0BAQEFAAOC\n-----END CERTIFICATE-----\n",  # cut short
        b"-----BEGIN CERTIFICATE-----\n!!not base64!!\n-----END CERTIFICATE-----\n",
    ],
)
def test_what_cannot_be_read_is_none_never_an_error(pem: bytes) -> None:
    assert validity_of(pem) is None


def test_problem_names_the_date_in_utc() -> None:
    validity = Validity(1_000_000.0, 2_000_000.0)
    assert validity.problem(1_500_000.0) == ""
    assert validity.problem(2_000_001.0) == "expired at 1970-01-24T03:33:20Z"
    assert validity.problem(999_999.0) == "is not valid before 1970-01-12T13:46:40Z"
