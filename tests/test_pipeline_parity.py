"""Pipeline parity on real E2E data (issue 3): 200 LoRA steps in torch and jittor from the same
weights and data order give per-step losses within 1e-3 relative, and beam outputs are
token-identical on >= 98% of 50 test MRs; with dropout on, parity mode keeps both bounds."""

from __future__ import annotations

import pytest

from examples.nlg.parity import run


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_e2e_pipeline_parity(shared_dir, tmp_path, dropout):
    rep = run(shared_dir / "data", tmp_path, steps=200, test_mrs=50, dropout=dropout, progress=False)
    print(rep)
    assert rep["steps"] == 200
    assert rep["last_loss"] < rep["first_loss"] - 1.0, "training did not learn: the comparison would be vacuous"
    assert rep["max_rel_loss_diff"] <= 1e-3
    assert rep["identical_share"] >= 0.98
