"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared data folder: ``$LORA_SHARED`` or ``../shared`` beside the project root."""
    return Path(os.environ.get("LORA_SHARED", Path(__file__).resolve().parents[2] / "shared"))
