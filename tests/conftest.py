"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared data folder: ``$LORA_SHARED`` or ``../shared`` beside the project root."""
    return Path(os.environ.get("LORA_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def _backend_names() -> list[str]:
    names = [n.strip() for n in os.environ.get("LORA_TEST_BACKENDS", "torch,jittor").split(",") if n.strip()]
    bad = [n for n in names if n not in ("torch", "jittor")]
    if bad:
        raise ValueError(f"LORA_TEST_BACKENDS: unknown backend(s) {bad}; use torch and/or jittor")
    return names


@pytest.fixture(params=_backend_names(), scope="session")
def backend(request):
    """Each backend named in ``$LORA_TEST_BACKENDS`` (default both). A backend that fails
    to import fails the test (reported, never silently skipped)."""
    from lora_core import get_backend

    return get_backend(request.param)


def pytest_terminal_summary(terminalreporter):
    """Print the measured parity ratios (max|diff| / scale) so CI logs show the figures."""
    from helpers import MEASURED

    if MEASURED:
        terminalreporter.section("parity: measured max|diff| / scale")
        for name in sorted(MEASURED):
            terminalreporter.write_line(f"{name:60s} {MEASURED[name]:.3e}")
