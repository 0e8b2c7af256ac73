"""``run(settings)`` against stores that misbehave in ways no single request shows, with the real Triton: a store
that lists slowly — each page just in time, or without end — which ``--download-timeout-s`` must bound, leaving
nothing in staging or the repository."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.loader.test_run import expect_failure, settings
from tests.support.storage import SlowS3Lister
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode, TransientSourceError
from tritonshare.common.layout import NodeLayout

pytestmark = [pytest.mark.triton, pytest.mark.storage]


@pytest.mark.parametrize(
    "slowness",
    [{"page_delay_s": 0.3}, {"page_delay_s": 0.0, "pages": 1, "trickle": True}],
    ids=["slow pages without end", "one page trickling in"],
)
def test_a_listing_that_does_not_end_stops_at_the_download_deadline(
    layout: NodeLayout,
    triton: TritonServer,
    slow_s3: Callable[..., SlowS3Lister],
    model_name: str,
    slowness: dict[str, object],
) -> None:
    # each read came in well within its own timeout: the listing went on for as long as the store did (for ever)
    store = slow_s3(**slowness)
    conf = settings(layout, triton, "s3://models/m", model_name, download_timeout_s=2.0)
    started = time.monotonic()
    error = expect_failure(
        TransientSourceError,
        ExitCode.SOURCE_TRANSIENT,
        r"s3://models/m: listing did not finish within 2 s \(--download-timeout-s covers the listing and the "
        r"transfer\)",
        layout,
        conf,
    )
    assert 2.0 <= time.monotonic() - started < 4.0, error
    assert store.pages_asked >= 1


def test_the_transfer_has_what_the_listing_left_of_the_deadline(
    layout: NodeLayout, triton: TritonServer, slow_s3: Callable[..., SlowS3Lister], model_name: str
) -> None:
    store = slow_s3(pages=4, page_delay_s=0.5)  # a listing of 2 s, then objects that trickle in
    conf = settings(layout, triton, "s3://models/m", model_name, download_timeout_s=3.0)
    started = time.monotonic()
    expect_failure(
        TransientSourceError,
        ExitCode.SOURCE_TRANSIENT,
        r"download did not finish within 3 s \(the listing took 2\.\d s of it\)",
        layout,
        conf,
    )
    assert time.monotonic() - started < 4.5  # not 2 s of listing + 3 s of transfer
    assert store.pages_asked == 4
