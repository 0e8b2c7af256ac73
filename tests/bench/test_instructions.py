"""bench/instructions.py: a counted window whose answers were not all successes gives no figure (h2load takes a
gRPC refusal, HTTP 200 with grpc-status 16, for a success, and a refusal costs few instructions)."""

from __future__ import annotations

import pytest
from bench.instructions import check_answers

from tests.bench.test_answers import proxy, triton


def test_a_window_of_successes_and_one_cut_per_connection_passes() -> None:
    check_answers("tritonshare rest", (triton(0, 0), proxy(0, 0)), (triton(900, 0), proxy(900, 0, cut=1)), 1)
    check_answers("nginx grpc", (triton(0, 3), ""), (triton(900, 3), ""), 1)  # no proxy page: Triton's count


@pytest.mark.parametrize(
    ("before", "after", "shown"),
    [
        ((triton(0, 0), proxy(0, 0)), (triton(900, 0), proxy(900, 0, refused=5)), "other {('grpc', 'unavailable'): 5}"),
        ((triton(0, 0), proxy(0, 0)), (triton(900, 0), proxy(900, 0, cut=2)), "cut 2"),
        ((triton(0, 1), ""), (triton(900, 9), ""), "Triton failed 8"),
    ],
)
def test_a_window_with_a_refusal_a_failure_or_too_many_cuts_stops_the_run(
    before: tuple[str, str], after: tuple[str, str], shown: str
) -> None:
    with pytest.raises(SystemExit, match="not every answer was a success") as stopped:
        check_answers("tritonshare+token grpc", before, after, 1)
    assert shown in str(stopped.value)
