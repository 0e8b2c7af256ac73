"""The metrics port's probes, against the real Triton: where the kubelet asks ``/v2/health/ready`` (the
manifests' readinessProbe), because the REST port holds at most ``--max-connections`` client connections and
anyone who reaches it can fill them with connections that never send a byte."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import pytest

from tests.proxy.conftest import RecordingModel, ServedModels
from tests.proxy.test_overload import LIVE, _metric, _until
from tests.proxy.test_rest import Raw
from tests.proxy.test_rest_access import get, infer
from tests.support.metrics_pages import MetricsPort
from tests.support.proxy import ProxyProcess
from tritonshare.proxy.metrics_server import MAX_CONNECTIONS

pytestmark = pytest.mark.triton


def test_the_probes_on_the_metrics_port_answer_while_silent_connections_fill_the_rest_port(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    proxy = start_proxy(served_models.own, "--no-unload", "--max-connections", "4")
    silent = [socket.create_connection(("127.0.0.1", proxy.http_port)) for _ in range(4)]  # no token, no byte
    try:
        _until(lambda: _metric(proxy, "tritonshare_proxy_client_connections", protocol="rest") == 4)
        with Raw(proxy.http_port) as turned_away:  # the REST port's probe is one connection too many
            assert turned_away.send(LIVE).response()[0] == 503
        assert get(proxy.metrics_port, "/v2/health/ready")[0] == 200
        assert get(proxy.metrics_port, "/v2/health/live")[0] == 200
    finally:
        for sock in silent:
            sock.close()


def test_the_metrics_port_says_not_ready_for_a_model_triton_does_not_serve(
    start_proxy: Callable[..., ProxyProcess],
) -> None:
    proxy = start_proxy("never-installed", "--no-unload")
    status, _, body = get(proxy.metrics_port, "/v2/health/ready")
    assert (status, body) == (400, b"not ready\n")
    assert get(proxy.metrics_port, "/v2/health/live")[0] == 200  # Triton is live all the same


def test_the_metrics_port_says_not_ready_from_the_moment_a_drain_begins(
    start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    model = recording_model(3.0)
    proxy = start_proxy(model.name, "--no-unload", "--drain-timeout-s", "20")
    assert get(proxy.metrics_port, "/v2/health/ready")[0] == 200
    running = threading.Thread(target=infer, args=(proxy.http_port, model.name, 1.0))  # keeps the drain going
    running.start()
    time.sleep(0.5)
    assert proxy.process is not None
    proxy.process.send_signal(15)
    _until(lambda: get(proxy.metrics_port, "/v2/health/ready")[0] == 503, timeout_s=2)
    assert proxy.process.poll() is None  # still draining: the probe says so before the proxy goes
    running.join()
    assert proxy.process.wait(timeout=60) == 0


def _open_fds(proxy: ProxyProcess) -> int:
    return len(os.listdir(f"/proc/{proxy.pid}/fd"))


def _closed_unanswered(sock: socket.socket) -> bool:
    """Whether the proxy closed ``sock`` without a byte of answer (its probe, sent, gets nothing back)."""
    sock.settimeout(5)
    try:
        sock.sendall(LIVE)
        return sock.recv(1024) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_a_flood_of_silent_connections_to_the_metrics_port_is_capped_and_probes_answer_through_it(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """Uncapped, each silent connection held a descriptor for 10 s: a flood used the open-files limit, past
    which every port's accepts fail. Capped by closing newcomers, 64 silent connections would have made the pod
    unready. The port holds MAX_CONNECTIONS, and a newcomer closes the oldest that has asked nothing."""
    proxy = start_proxy(served_models.own, "--no-unload")
    before = _open_fds(proxy)
    silent = [socket.create_connection(("127.0.0.1", proxy.metrics_port)) for _ in range(MAX_CONNECTIONS)]
    flood: list[socket.socket] = []
    try:
        _until(lambda: _open_fds(proxy) >= MAX_CONNECTIONS)  # the proxy holds them
        flood = [socket.create_connection(("127.0.0.1", proxy.metrics_port)) for _ in range(2 * MAX_CONNECTIONS)]
        # every newcomer past the cap closed one: the flood's 128, and the scrape asking this its own
        _until(lambda: _metric(proxy, "tritonshare_proxy_refusals_total", protocol="metrics") > 2 * MAX_CONNECTIONS)
        assert all(_closed_unanswered(sock) for sock in silent)  # the oldest silent ones made room
        assert _open_fds(proxy) < before + MAX_CONNECTIONS + 8  # not one descriptor per connection
        for _ in range(3):  # the flood's connections still fill the port: a probe is answered all the same
            assert get(proxy.metrics_port, "/v2/health/ready")[0] == 200
        # Logged once per spell of a full port, not per connection closed (192 were): a scrape that ends between
        # the flood's accepts gives the port room, and the next closing begins another spell.
        warnings = proxy.log_text().count(f"the metrics port {proxy.metrics_port} holds {MAX_CONNECTIONS}")
        assert 1 <= warnings <= 5
    finally:
        for sock in silent + flood:
            sock.close()
    _until(lambda: get(proxy.metrics_port, "/v2/health/live")[0] == 200)


def test_scrapes_waiting_on_a_slow_triton_metrics_port_are_answered_within_the_scrape_timeout(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """Triton's part of the page is given up at the proxy's deadline (--connect-timeout-s, 2 s): the scrapes
    are answered within the PodMonitor's 5 s scrapeTimeout, Triton's series reported down. They waited for the
    page to end, each holding a thread and a connection of the metrics port, the connections that the probe
    needs once 64 are held."""
    slow = MetricsPort.dripping()
    try:
        proxy = start_proxy(served_models.own, "--no-unload", "--triton-metrics-url", slow.url)
        took: list[float] = []
        scrapes = [threading.Thread(target=_scrape, args=(proxy, took)) for _ in range(12)]
        for scrape in scrapes:
            scrape.start()
        for scrape in scrapes:
            scrape.join(timeout=30)

        assert len(took) == 12 and max(took) < 5.0, took
        assert slow.accepted <= 3, "scrapes that waited for a fetch take its answer, not a fetch each"
        assert get(proxy.metrics_port, "/v2/health/ready")[0] == 200
    finally:
        slow.close()


def _scrape(proxy: ProxyProcess, took: list[float]) -> None:
    """One scrape; its time goes into ``took`` if it was answered with Triton's part reported down."""
    started = time.monotonic()
    status, _, body = get(proxy.metrics_port, "/metrics")
    if status == 200 and f'tritonshare_proxy_triton_metrics_up{{model="{proxy.name}"}} 0.0'.encode() in body:
        took.append(time.monotonic() - started)
