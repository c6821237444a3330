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


# Test files that take about a minute or more (their tests' durations summed, 2 workers, warm
# kernel cache, 2-core AMD EPYC: 348 s for the pipeline parity down to 55 s for full FT): under
# pytest-xdist (``scripts/lora.sh test`` runs ``-n`` workers with ``--dist loadfile``, one file's
# tests on one worker) they are handed out first, longest first, so that no worker starts a long
# file when the others are nearly done. A file not listed keeps its place after them.
HEAVY_FIRST = (
    "test_pipeline_parity.py",
    "test_lm_bench.py",
    "test_zero.py",
    "test_bench.py",
    "test_compile.py",
    "test_distributed.py",
    "test_cls_train.py",
    "test_precision.py",
    "test_qlora_memory.py",
    "test_eval.py",
    "test_lm_task.py",
    "test_train_quantize.py",
    "test_train.py",
    "test_full_ft.py",
)


def pytest_collection_modifyitems(config, items):
    """Under xdist (a worker's collection; every worker sorts alike), the heavy files first."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


_REPORTED: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the parity ratios a test measured to its report, so that they reach the
    controlling process under xdist (workers fill ``helpers.MEASURED`` in their own memory)."""
    outcome = yield
    if call.when != "teardown" or not hasattr(item.config, "workerinput"):  # one process: MEASURED is already here
        return
    from helpers import MEASURED

    new = {k: v for k, v in MEASURED.items() if _REPORTED.get(k) != v}
    if new:
        _REPORTED.update(new)
        outcome.get_result().user_properties.append(("parity_measured", new))


def pytest_runtest_logreport(report):
    """In the controlling process: collect the ratios the workers' reports carry."""
    from helpers import MEASURED

    for key, value in getattr(report, "user_properties", ()):
        if key == "parity_measured":
            for name, ratio in value.items():
                MEASURED[name] = max(MEASURED.get(name, 0.0), ratio)


def pytest_terminal_summary(terminalreporter):
    """Print the measured parity ratios (max|diff| / scale) so CI logs show the figures."""
    from helpers import MEASURED

    if MEASURED:
        terminalreporter.section("parity: measured max|diff| / scale")
        for name in sorted(MEASURED):
            terminalreporter.write_line(f"{name:60s} {MEASURED[name]:.3e}")
