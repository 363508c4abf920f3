"""Under --optimizer muon, which parameters DeepSpeed's optimizer actually steps with Muon: read from its
param groups (tests/training/muon_groups_script.py, one CPU process through the trainer's `engine_for`)."""
import json
import os
import subprocess
import sys

import pytest

from ..conftest import ROOT


@pytest.mark.parametrize("stage", ["2", "3"])
def test_muon_steps_matrices_and_adamw_the_codebooks_base_kernels_norms(stage):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(ROOT / "tests/training/muon_groups_script.py"), stage], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("MUON_GROUPS=")), None)
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(line.split("=", 1)[1])
    assert report["optimizer"] == "MuonWithAuxAdam"
    muon = {n for g in report["groups"] if g["use_muon"] for n in g["params"]}
    adamw = {n for g in report["groups"] if not g["use_muon"] for n in g["params"]}
    assert {"candidate_selector.predecessor_codebook.weight", "candidate_selector.successor_codebook.weight",
            "layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.base_kernel", "norm.weight"} <= adamw
    assert {"candidate_selector.hidden_projection.weight", "layers.0.attention_conv.kernel_projection.weight",
            "layers.1.self_attn.q_proj.weight", "fc.weight"} <= muon
    assert not muon & adamw and all(n.endswith(("weight", "base_kernel")) for n in muon | adamw)
    assert not any("codebook" in n or "base_kernel" in n or "norm" in n for n in muon)
