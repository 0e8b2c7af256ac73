"""SigV4 signing against AWS's published examples, and where credentials come from (pure logic; the same
signatures are accepted by a signature-checking server in test_sources_s3.py)."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tritonshare.common.errors import SourceAccessDenied, TransientSourceError
from tritonshare.loader.sources.s3_auth import CredentialChain, Credentials, Signer, from_environment

# "Authenticating Requests: Using the Authorization Header (AWS Signature Version 4)", examples section
EXAMPLE_KEYS = Credentials(access_key="AKIAIOSFODNN7EXAMPLE", secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
EXAMPLE_DAY = datetime(2013, 5, 24, tzinfo=timezone.utc)
EXAMPLE_HOST = "examplebucket.s3.amazonaws.com"


def example_signer() -> Signer:
    return Signer("us-east-1", clock=lambda: EXAMPLE_DAY)


def test_get_object_with_a_range_matches_the_aws_example() -> None:
    headers = example_signer().sign("GET", "/test.txt", "", {"host": EXAMPLE_HOST, "range": "bytes=0-9"}, EXAMPLE_KEYS)
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )
    assert headers["x-amz-date"] == "20130524T000000Z"


def test_list_objects_matches_the_aws_example() -> None:
    headers = example_signer().sign("GET", "/", "max-keys=2&prefix=J", {"host": EXAMPLE_HOST}, EXAMPLE_KEYS)
    assert headers["authorization"].endswith(
        "Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"
    )


def test_a_session_token_is_sent_and_signed() -> None:
    keys = Credentials(access_key="AKID", secret_key="secret", token="session-token")
    headers = example_signer().sign("GET", "/k", "", {"host": EXAMPLE_HOST}, keys)
    assert headers["x-amz-security-token"] == "session-token"
    assert "SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-security-token," in headers["authorization"]


def test_the_environment_gives_keys_and_an_optional_token() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": "t"}
    assert from_environment(env) == Credentials(access_key="AKID", secret_key="secret", token="t")
    assert from_environment({"AWS_ACCESS_KEY_ID": "AKID"}) is None


def test_secrets_never_show_in_a_repr() -> None:
    text = repr(Credentials(access_key="AKID", secret_key="very-secret", token="very-token"))
    assert "AKID" in text and "very-secret" not in text and "very-token" not in text


def test_without_keys_in_the_environment_the_shared_credentials_file_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "credentials").write_text("[models]\naws_access_key_id = FROMFILE\naws_secret_access_key = s3cr3t\n")
    (tmp_path / "config").write_text("[profile models]\nregion = eu-west-3\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "models")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    chain = CredentialChain({}, "s3://b/m")
    assert not chain.static
    assert chain.get() == Credentials(access_key="FROMFILE", secret_key="s3cr3t")
    assert chain.region() == "eu-west-3"


def test_no_credentials_anywhere_is_access_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(SourceAccessDenied, match=r"s3://b/m: no usable credentials .*check the pod's credentials"):
        CredentialChain({}, "s3://b/m").get()


# ---- IRSA (EKS web identity): the token file and STS's answer ------------------------------------------

ROLE = "arn:aws:iam::123456789012:role/models-reader"
STS_DENIED = (
    b'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>Sender</Type>'
    b"<Code>AccessDenied</Code><Message>Not authorized to perform sts:AssumeRoleWithWebIdentity</Message>"
    b"</Error><RequestId>r-1</RequestId></ErrorResponse>"
)


class DenyingSts(http.server.BaseHTTPRequestHandler):
    """STS refusing every AssumeRoleWithWebIdentity, as it does when the role's trust policy does not name the
    pod's service account."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(403)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(STS_DENIED)))
        self.end_headers()
        self.wfile.write(STS_DENIED)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def denying_sts() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DenyingSts)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def irsa(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, token_file: Path, sts_url: str) -> CredentialChain:
    """The environment EKS gives a pod whose service account names a role; no other credentials."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ROLE_ARN", ROLE)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts_url)
    return CredentialChain(os.environ, "s3://b/m")


def test_a_missing_web_identity_token_file_is_access_denied_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, denying_sts: str
) -> None:
    chain = irsa(monkeypatch, tmp_path, tmp_path / "nonexist" / "token", denying_sts)
    with pytest.raises(
        SourceAccessDenied, match=rf"s3://b/m: cannot read {tmp_path}/nonexist/token .*check the projected token"
    ):
        chain.get()


def test_sts_refusing_the_role_is_access_denied_naming_the_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, denying_sts: str
) -> None:
    (tmp_path / "token").write_text("eyJhbGciOiJSUzI1NiJ9.e30.c2ln")
    chain = irsa(monkeypatch, tmp_path, tmp_path / "token", denying_sts)
    with pytest.raises(SourceAccessDenied) as caught:
        chain.get()
    message = str(caught.value)
    assert f"STS refused credentials for role {ROLE}" in message
    assert "AccessDenied" in message and "check the role's trust policy for this service account" in message


def test_an_unreachable_sts_is_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("eyJhbGciOiJSUzI1NiJ9.e30.c2ln")
    chain = irsa(monkeypatch, tmp_path, tmp_path / "token", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TransientSourceError, match=rf"fetching credentials for role {ROLE} failed .*STS"):
        chain.get()
