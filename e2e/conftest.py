"""Fixtures for the end-to-end suite; they live in e2ekit.py, which the tests also import helpers from."""

from e2ekit import cluster, namespace, operator  # noqa: F401  (pytest fixtures)
