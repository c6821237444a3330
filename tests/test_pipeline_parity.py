"""Pipeline parity on real E2E data (issue 3): 200 LoRA steps in torch and jittor from the same
weights and data order give per-step losses within 1e-3 relative, and beam outputs are
token-identical on >= 98% of 50 test MRs; with dropout on, parity mode keeps both bounds."""

from __future__ import annotations

import pytest

from examples.nlg.parity import run


@pytest.mark.slow
def test_e2e_pipeline_parity(shared_dir, tmp_path):
    reps = run(shared_dir / "data", tmp_path, steps=200, test_mrs=50, dropouts=(0.0, 0.1), progress=False)
    for rep in reps:
        print(rep)
        assert rep["steps"] == 200
        assert rep["last_loss"] < rep["first_loss"], "training did not learn"
        # a model that stops at once would make identical beams vacuous
        assert rep["mean_generated_len"] > 8, rep
        assert rep["max_rel_loss_diff"] <= 1e-3
        assert rep["identical_share"] >= 0.98
