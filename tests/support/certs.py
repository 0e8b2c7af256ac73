"""A throw-away certificate authority for TLS tests: server certificates for localhost and 127.0.0.1."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPublicKeyTypes
from cryptography.x509.oid import NameOID


class CertificateAuthority:
    """A certificate authority issuing server certificates for localhost and 127.0.0.1."""

    def __init__(self, name: str = "tritonshare test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            _builder(subject, subject, self.key.public_key(), serial=1)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def write_ca(self, path: Path) -> Path:
        path.write_bytes(self.pem)
        return path

    def issue(
        self,
        serial: int,
        *,
        not_before: datetime.datetime | None = None,
        not_after: datetime.datetime | None = None,
    ) -> tuple[bytes, bytes]:
        """(certificate PEM, unencrypted key PEM) of a server certificate with this serial number, valid from 5
        minutes ago for a day unless ``not_before`` / ``not_after`` say otherwise."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (
            _builder(
                x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proxy")]),
                self.cert.subject,
                key.public_key(),
                serial,
                not_before=not_before,
                not_after=not_after,
            )
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    def write_pair(self, folder: Path, serial: int) -> tuple[Path, Path]:
        """Issue a certificate and write it as ``folder/tls.crt`` and ``folder/tls.key`` (each replaced in
        one rename, the key first); returns their paths."""
        cert_pem, key_pem = self.issue(serial)
        cert, key = folder / "tls.crt", folder / "tls.key"
        write_atomically(key, key_pem)
        write_atomically(cert, cert_pem)
        return cert, key


def serial_of(cert_der: bytes) -> int:
    """The serial number of a DER certificate (what a client saw)."""
    return int(x509.load_der_x509_certificate(cert_der).serial_number)


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: CertificateIssuerPublicKeyTypes,
    serial: int,
    *,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(serial)
        .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + datetime.timedelta(days=1))
    )


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.rename(tmp, path)
