"""Benchmarks measure release builds only: a debug build's numbers mean nothing."""

import pytest

import kvsched


def pytest_configure(config: pytest.Config) -> None:
    enabled = not config.getoption("benchmark_disable", default=True)
    if enabled and kvsched.build_profile != "release":
        raise pytest.UsageError(
            f"kvsched is a {kvsched.build_profile} build; benchmark a release build "
            "(pip install -e . builds one)"
        )
