"""The jittor path never imports torch: run it in a fresh process where torch cannot import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (import of {name!r})")
    sys.meta_path.insert(0, Block())
    import numpy as np
    import lora_core as lc
    from lora_core.data.batching import collate
    from lora_core.generate.beam import BeamConfig
    bj = lc.get_backend("jittor")
    cfg, lora = lc.gpt2_config("tiny-32"), lc.LoRAConfig(r=2, alpha=4)
    out = sys.argv[1]
    lc.save_model(out + "/base", cfg, lc.init_gpt2_weights(cfg))
    m = bj.from_pretrained(out + "/base", lora=lora)
    opt = bj.AdamW(bj.trainable_parameters(m))
    batch = collate([([1, 2, 3], [4, 5, 0]), ([6, 7], [8, 9, 10, 0])])
    loss = bj.train_step(m, opt, [batch], 1e-2)["loss"]
    lc.save_adapter(out + "/ad", cfg, lora, bj.lora_state_dict(m))
    m2 = bj.from_pretrained(out + "/base", adapter=out + "/ad")
    assert np.allclose(m(batch["input_ids"])[0].numpy(), m2(batch["input_ids"])[0].numpy())
    # a torch-format checkpoint (written by the parent process) loads without torch
    cfg_bin, w = lc.load_gpt2_checkpoint(out + "/bin/pytorch_model.bin", cfg)
    bj.build_model(cfg_bin, None, w)
    print(bj.beam_search(m, [[1, 2, 3]], BeamConfig(beam=2, max_new_tokens=3, stop_ids=(0,))))
    assert "torch" not in sys.modules, "torch was imported"
    print("ok", loss)
""")


def test_jittor_backend_runs_without_torch(tmp_path):
    import torch

    import lora_core as lc
    cfg = lc.gpt2_config("tiny-32")
    (tmp_path / "bin").mkdir()
    torch.save({k: torch.from_numpy(v.T.copy() if k.endswith(lc.models.gpt2.TRANSPOSED) else v)
                for k, v in lc.init_gpt2_weights(cfg).items()}, tmp_path / "bin" / "pytorch_model.bin")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
