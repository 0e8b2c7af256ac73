"""Fault-injection scripts: each drives a real fault against real processes and prints its figure.

Run from the repository root after ``scripts/setup.sh`` (they need ``.venv-triton``), e.g.::

    .venv/bin/python -m bench.faults.kill_loader --runs 200
    .venv/bin/python -m bench.faults.sigterm_load
    .venv/bin/python -m bench.faults.soak

``tests/reliability`` runs small versions of the same code in CI.
"""
