"""Bearer-token authentication: parsing, constant-time comparison, reloading a changed token file (a
Kubernetes Secret's ``..data`` symlink swap included), failures, metrics, and the routes left open."""

from __future__ import annotations

import hmac
import logging
import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tritonshare.common.errors import UsageError
from tritonshare.proxy import auth
from tritonshare.proxy.auth import OPEN_GRPC_ROUTES, OPEN_REST_ROUTES, BearerTokens
from tritonshare.proxy.policy import GRPC_RULES, REST_MODEL_ROUTES, REST_SERVER_ROUTES, Verdict


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def tokens_at(path: Path, clock: Clock, registry: CollectorRegistry | None = None) -> BearerTokens:
    return BearerTokens(path, clock=clock, registry=registry, model="m")


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_right_token_passes_on_both_protocols_and_wrong_or_missing_ones_do_not(tmp_path: Path, clock: Clock) -> None:
    tokens = tokens_at(write(tmp_path / "t", "s3cret-A\n"), clock)
    assert tokens.check_http(b"Bearer s3cret-A")
    assert tokens.check_grpc(b"Bearer s3cret-A")
    for value in (None, b"", b"Bearer", b"Bearer ", b"s3cret-A", b"Basic s3cret-A", b"Bearer s3cret-a", b"Bearer x"):
        assert not tokens.check_http(value), value
        assert not tokens.check_grpc(value), value


def test_scheme_is_case_insensitive_and_spaces_around_are_ignored(tmp_path: Path, clock: Clock) -> None:
    tokens = tokens_at(write(tmp_path / "t", "abc.DEF_123~+/=\n"), clock)
    for value in (b"bearer abc.DEF_123~+/=", b"BEARER abc.DEF_123~+/=", b"  Bearer   abc.DEF_123~+/=  "):
        assert tokens.check_http(value), value
    assert not tokens.check_http(b"Bearer abc.DEF_123~+/= extra")


def test_several_tokens_comments_and_blank_lines(tmp_path: Path, clock: Clock) -> None:
    path = write(tmp_path / "t", "# rotation: new first\n\n  new-token  \n#old-token-commented\nold-token\n\n")
    tokens = tokens_at(path, clock)
    assert tokens.count == 2
    assert tokens.check_http(b"Bearer new-token") and tokens.check_http(b"Bearer old-token")
    assert not tokens.check_http(b"Bearer old-token-commented")
    assert not tokens.check_http(b"Bearer #old-token-commented")


def test_every_token_is_compared_in_constant_time_without_early_exit(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = tokens_at(write(tmp_path / "t", "first\nsecond-longer-token\nthird\n"), clock)
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # the module attribute auth calls
    assert tokens.check_http(b"Bearer first")  # matches the first token, yet all three are compared
    assert calls == [(32, 32)] * 3  # digests of equal length: the token's length does not show either
    calls.clear()
    assert not tokens.check_http(b"Bearer nope")
    assert calls == [(32, 32)] * 3


def test_a_changed_file_is_picked_up_within_a_second_not_before(tmp_path: Path, clock: Clock) -> None:
    path = write(tmp_path / "t", "old\n")
    tokens = tokens_at(path, clock)
    write(path, "new-and-longer\n")
    clock.now += 0.5
    assert tokens.check_http(b"Bearer old")  # not looked at again yet: at most one stat per second
    clock.now += 0.6
    assert tokens.check_http(b"Bearer new-and-longer")
    assert not tokens.check_http(b"Bearer old")
    assert tokens.stats["reloads"] == 1
    write(path, "newest\n")  # looked at 1.1 s in: the next look is due a full interval later, at 2.1 s
    clock.now += 0.5
    assert tokens.check_http(b"Bearer new-and-longer")
    clock.now += 0.5  # exactly one interval since the last look: due now
    assert tokens.check_http(b"Bearer newest")


def test_the_generation_changes_with_every_reload_and_only_then(tmp_path: Path, clock: Clock) -> None:
    """A front end keeps a head's verdict stamped with it: the stamp must go stale the moment a reload counts."""
    path = write(tmp_path / "t", "old\n")
    tokens = tokens_at(path, clock)
    first = tokens.current()
    clock.now += 1.1
    assert tokens.current() == first  # looked at, unchanged: the verdicts stand
    write(path, "new-and-longer\n")
    clock.now += 0.5
    assert tokens.current() == first  # not looked at again yet, as for a full check
    clock.now += 0.6
    assert tokens.current() != first and tokens.stats["reloads"] == 1
    assert not tokens.check_http(b"Bearer old")
    path.unlink()
    clock.now += 1.1
    before = tokens.current()  # a file that cannot be read keeps the tokens, and so the verdicts
    clock.now += 1.1
    assert tokens.current() == before and tokens.stats["reload_errors"] == 2


def test_unchanged_file_is_not_read_again(tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tokens_at(write(tmp_path / "t", "tok\n"), clock)
    reads: list[Path] = []
    real_read = auth._read

    def counting_read(path: Path) -> tuple[auth._FileIdentity, list[bytes], list[int]]:
        reads.append(path)
        return real_read(path)

    monkeypatch.setattr(auth, "_read", counting_read)
    for _ in range(5):
        clock.now += 1.5
        assert tokens.check_http(b"Bearer tok")
    assert reads == [] and tokens.stats["reloads"] == 0


def kubernetes_secret(root: Path, version: str, content: str) -> Path:
    """A Secret volume as the kubelet lays it out: ``token -> ..data/token``, ``..data -> ..<version>``."""
    (root / f"..{version}").mkdir(parents=True)
    write(root / f"..{version}" / "token", content)
    os.symlink(f"..{version}", root / "..data")
    os.symlink("..data/token", root / "token")
    return root / "token"


def swap_secret(root: Path, old: str, new: str, content: str) -> None:
    """The kubelet's atomic update: write a new folder, swap ``..data`` with one rename, delete the old."""
    (root / f"..{new}").mkdir()
    write(root / f"..{new}" / "token", content)
    os.symlink(f"..{new}", root / "..data_tmp")
    os.rename(root / "..data_tmp", root / "..data")
    shutil.rmtree(root / f"..{old}")


def test_kubernetes_secret_update_by_symlink_swap_is_picked_up(tmp_path: Path, clock: Clock) -> None:
    path = kubernetes_secret(tmp_path / "secret", "2024_01", "token-one\n")
    tokens = tokens_at(path, clock)
    assert tokens.check_http(b"Bearer token-one")
    swap_secret(tmp_path / "secret", "2024_01", "2024_02", "token-two\n")
    clock.now += 1.1
    assert tokens.check_http(b"Bearer token-two")
    assert not tokens.check_http(b"Bearer token-one")


def test_symlink_swap_to_a_file_of_same_size_and_times_is_seen_by_its_inode(tmp_path: Path, clock: Clock) -> None:
    """Only the inode tells the two files apart: same size, mtime and ctime (both files' ctime set in one tick of
    the kernel's coarse clock; a file system with finer ctimes cannot hold this still and skips)."""
    for attempt in range(50):
        root = tmp_path / f"secret{attempt}"
        path = kubernetes_secret(root, "a", "tok-AAAA\n")
        (root / "..b").mkdir()
        new = write(root / "..b" / "token", "tok-BBBB\n")
        st = os.stat(path)
        os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # (sets both ctimes to now)
        before, after = os.stat(path), os.stat(new)
        if before.st_ctime_ns == after.st_ctime_ns:
            break
    else:
        pytest.skip("this file system's ctime differs between two calls: it cannot hold a ctime still")
    same = ("st_dev", "st_size", "st_mtime_ns", "st_ctime_ns")
    assert [getattr(before, f) for f in same] == [getattr(after, f) for f in same]
    assert before.st_ino != after.st_ino
    tokens = tokens_at(path, clock)
    os.symlink("..b", root / "..data_tmp")  # the kubelet's swap (swap_secret), of the folder made above
    os.rename(root / "..data_tmp", root / "..data")
    shutil.rmtree(root / "..a")
    clock.now += 1.1
    assert tokens.check_http(b"Bearer tok-BBBB") and not tokens.check_http(b"Bearer tok-AAAA")


def test_a_file_written_on_windows_crlf_and_a_byte_order_mark_gives_its_tokens(tmp_path: Path, clock: Clock) -> None:
    """Notepad and PowerShell 5 write UTF-8 with a BOM and CRLF; ``kubectl create secret --from-file`` keeps both."""
    root = tmp_path / "secret"
    path = kubernetes_secret(root, "2024_01", "\ufeffwin-token-1\r\n# old one below\r\nwin-token-2\r\n")
    tokens = tokens_at(path, clock)
    assert tokens.count == 2
    assert tokens.check_http(b"Bearer win-token-1") and tokens.check_grpc(b"Bearer win-token-2")
    swap_secret(root, "2024_01", "2024_02", "\ufeffwin-token-3\r\n")
    clock.now += 1.1
    assert tokens.check_http(b"Bearer win-token-3") and not tokens.check_http(b"Bearer win-token-1")
    assert tokens.count == 1


def test_a_vanished_file_keeps_the_tokens_loaded_and_warns_once(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "t", "tok\n")
    tokens = tokens_at(path, clock)
    path.unlink()
    with caplog.at_level(logging.WARNING, logger="tritonshare.proxy.auth"):
        for _ in range(3):
            clock.now += 1.1
            assert tokens.check_http(b"Bearer tok")
    assert [r.getMessage() for r in caplog.records] == [
        f"--auth-token-file {path}: cannot stat it (No such file or directory); keeping the 1 tokens loaded"
    ]
    assert tokens.stats["reload_errors"] == 3
    write(path, "back\n")
    clock.now += 1.1
    assert tokens.check_http(b"Bearer back") and not tokens.check_http(b"Bearer tok")
    path.unlink()  # vanishing again after a good read is news again: warned again
    with caplog.at_level(logging.WARNING, logger="tritonshare.proxy.auth"):
        clock.now += 1.1
        assert tokens.check_http(b"Bearer back")
    assert len([r for r in caplog.records if "cannot stat it" in r.getMessage()]) == 2


def test_a_file_grown_past_a_secret_s_size_keeps_the_tokens_loaded(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Each check hashes the presented token against every token loaded: a file past what a Secret holds is not
    read (its read would also hold the event loop), and the tokens in force stay."""
    path = write(tmp_path / "t", "tok\n")
    tokens = tokens_at(path, clock)
    write(path, "tok\n" * ((1 << 20) // 4 + 1))
    clock.now += 1.1
    with caplog.at_level(logging.WARNING, logger="tritonshare.proxy.auth"):
        assert tokens.check_http(b"Bearer tok") and tokens.count == 1
    assert "larger than 1048576 bytes" in caplog.text and tokens.stats["reload_errors"] == 1


def test_an_emptied_file_refuses_everyone(tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "t", "tok\n")
    tokens = tokens_at(path, clock)
    write(path, "# all tokens revoked\n")
    clock.now += 1.1
    with caplog.at_level(logging.ERROR, logger="tritonshare.proxy.auth"):
        assert not tokens.check_http(b"Bearer tok")
    assert "no token left" in caplog.text and tokens.count == 0


def test_lines_that_cannot_be_tokens_are_reported_by_number_never_by_content(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "t", "good\n")
    tokens = tokens_at(path, clock)
    write(path, "good\nhas space-secret\nok2\n")
    clock.now += 1.1
    with caplog.at_level(logging.ERROR, logger="tritonshare.proxy.auth"):
        assert tokens.check_http(b"Bearer ok2")
    assert "line(s) 2 are not tokens" in caplog.text and "secret" not in caplog.text.replace(str(path), "")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "cannot read it (No such file or directory) — mount the Secret"),
        ("", "no token in it"),
        ("# only a comment\n\n", "no token in it"),
        ("tab\there\n", "line(s) 1 are not tokens"),
        ("x" * (1 << 20) + "\n", "cannot read it (larger than 1048576 bytes, the most a Kubernetes Secret holds)"),
    ],
)
def test_a_bad_file_at_start_is_a_usage_error_naming_it(
    tmp_path: Path, clock: Clock, content: str | None, words: str
) -> None:
    path = tmp_path / "tokens"
    if content is not None:
        write(path, content)
    with pytest.raises(UsageError) as err:
        tokens_at(path, clock)
    assert str(err.value).startswith(f"--auth-token-file {path}: ") and words in str(err.value)


def test_metrics_count_tokens_reloads_and_refusals(tmp_path: Path, clock: Clock) -> None:
    registry = CollectorRegistry()
    path = write(tmp_path / "t", "a\nb\n")
    tokens = tokens_at(path, clock, registry)
    tokens.check_http(None)
    tokens.check_grpc(b"Bearer wrong")
    tokens.check_grpc(b"Bearer a")
    write(path, "c\n")
    clock.now += 1.1
    tokens.check_http(b"Bearer c")
    model = {"model": "m"}  # as every proxy family: a node-wide Prometheus tells the tenants apart
    assert registry.get_sample_value("tritonshare_proxy_auth_tokens", model) == 1
    assert registry.get_sample_value("tritonshare_proxy_auth_reloads_total", model) == 1
    assert registry.get_sample_value("tritonshare_proxy_auth_reload_errors_total", model) == 0
    assert registry.get_sample_value("tritonshare_proxy_auth_refused_total", {**model, "reason": "missing"}) == 1
    assert registry.get_sample_value("tritonshare_proxy_auth_refused_total", {**model, "reason": "invalid"}) == 1


def test_open_routes_are_only_probes_the_proxy_answers_itself() -> None:
    """Open routes are never forwarded per request (a flood of them would reach the shared Triton unthrottled)."""
    rest_rules = {rule.route: rule for rule in (*REST_SERVER_ROUTES.values(), *REST_MODEL_ROUTES.values())}
    grpc_rules = {rule.route: rule for rule in GRPC_RULES.values()}
    for route in OPEN_REST_ROUTES:
        assert rest_rules[route].verdict in (Verdict.LIVE, Verdict.READY), route
    for route in OPEN_GRPC_ROUTES:
        assert grpc_rules[route].verdict in (Verdict.LIVE, Verdict.READY), route
    assert "server_metadata" not in OPEN_REST_ROUTES and "ServerMetadata" not in OPEN_GRPC_ROUTES
    assert not {"infer", "model_metadata", "ModelInfer", "ModelStreamInfer"} & (OPEN_REST_ROUTES | OPEN_GRPC_ROUTES)


def test_a_file_of_exactly_a_secrets_size_is_read(tmp_path: Path, clock: Clock) -> None:
    head = "tok\n# "
    path = write(tmp_path / "t", head + "x" * ((1 << 20) - len(head) - 1) + "\n")
    assert path.stat().st_size == 1 << 20
    assert tokens_at(path, clock).check_http(b"Bearer tok")


def test_a_line_with_a_del_character_is_no_token(tmp_path: Path, clock: Clock) -> None:
    path = write(tmp_path / "t", "good\n")
    tokens = tokens_at(path, clock)
    write(path, "good\nbad\x7f\n")
    clock.now += 1.1
    assert tokens.check_http(b"Bearer good") and not tokens.check_http(b"Bearer bad\x7f")
    assert tokens.count == 1


def test_a_report_of_many_bad_lines_names_the_first_ten(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "t", "good\n")
    tokens = tokens_at(path, clock)
    write(path, "good\n" + "a b\n" * 12)
    clock.now += 1.1
    with caplog.at_level(logging.ERROR, logger="tritonshare.proxy.auth"):
        assert tokens.check_http(b"Bearer good")
    assert "line(s) 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 are not tokens" in caplog.text


def test_a_bearer_scheme_without_a_token_counts_as_missing(tmp_path: Path, clock: Clock) -> None:
    tokens = tokens_at(write(tmp_path / "t", "tok\n"), clock)
    assert not tokens.check_http(b"Bearer   ")
    assert (tokens.stats["missing"], tokens.stats["invalid"]) == (1, 0)
