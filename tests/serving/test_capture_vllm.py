"""Features from the engine (`capture_features.py --engine vllm`, the `serve` extra): vLLM computes the
demo target's tapped features and final states, and writes the store the Hugging Face capture writes, of
the same token store: the same files, meta (but the engine's name), offsets and shared weights bit for
bit, and features equal to fp32 rounding (vLLM's CPU kernels are not PyTorch's). One engine start."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (bash launch/install.sh serve; CI installs it)")

from dflash.demo import DATA, TARGET  # noqa: E402
from dflash.tools import capture_features  # noqa: E402

# vLLM taps the input of layer i + 1 for DFlash's layer i; without the + 1, tap 2 would hold tap 1's states
TAPS = "1,2,4"
# of the largest magnitude; measured on these conversations: 5.8e-7 for the taps, 7.9e-7 for the final states
# (about 10% of values bitwise equal)
ROUNDING = 4e-6


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The features of 8 demo conversations captured by transformers, then by vLLM from its token store in
    micro-batches of a few samples (requests batched, prompts prefilled in chunks beside each other)."""
    tmp = tmp_path_factory.mktemp("capture")
    data = tmp / "data.jsonl"
    data.write_text("".join(DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:8]), encoding="utf-8")
    common = ["--target", str(TARGET), "--dtype", "fp32", "--target-layer-ids", TAPS]
    capture_features.main([*common, "--data", str(data), "--output", str(tmp / "hf")])
    capture_features.main([*common, "--data", str(tmp / "hf" / "tokens"), "--output", str(tmp / "vllm"),
                           "--engine", "vllm", "--token-budget", "400"])
    return tmp / "hf", tmp / "vllm"


def arrays(folder):
    meta = json.loads((folder / "feature_store.json").read_text())
    taps, hidden = len(meta["target_layer_ids"]), meta["hidden_size"]
    return (np.fromfile(folder / "features.bin", np.float32).reshape(meta["tokens"], taps, hidden),
            np.fromfile(folder / "states.bin", np.float32).reshape(meta["tokens"], hidden))


def test_the_engine_writes_the_store_the_hugging_face_capture_writes(stores):
    import torch
    import vllm

    from dflash.data.token_store import TokenStore
    from dflash.features import load_captured
    from dflash.target.spec import load_target_spec

    hf, engine = stores
    metas = [json.loads((folder / "feature_store.json").read_text()) for folder in stores]
    assert (metas[0].pop("engine"), metas[1].pop("engine")) == ("transformers", f"vllm {vllm.__version__}")
    assert metas[0] == metas[1]
    assert sorted(p.name for p in hf.iterdir() if p.name != "tokens") == sorted(p.name for p in engine.iterdir())
    for name in ("offsets.npy", "shared.safetensors"):
        assert (hf / name).read_bytes() == (engine / name).read_bytes(), name
    # what train.py --features checks: the run's target, data and taps, and each file's size
    load_captured(engine, load_target_spec(TARGET), TokenStore(hf / "tokens"), "cpu", torch.float32,
                  metas[1]["target_layer_ids"])
    # the engine closed with its connector (its worker shuts the connector down): the next engine in this
    # process (the other serving tests) starts without one
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    assert not has_kv_transfer_group()


def test_its_features_are_the_hugging_face_capture_s_to_fp32_rounding(stores):
    (hf_taps, hf_states), (taps, states) = (arrays(folder) for folder in stores)
    scale = np.abs(hf_taps).max()
    for k in range(hf_taps.shape[1]):
        assert np.abs(taps[:, k] - hf_taps[:, k]).max() <= ROUNDING * scale, f"tap {k}"
        # the tolerance tells layers apart: another tap (tap 1 is tap 2 without vLLM's + 1) is far outside it
        for other in range(hf_taps.shape[1]):
            if other != k:
                assert np.abs(taps[:, k] - hf_taps[:, other]).max() > 100 * ROUNDING * scale
    assert np.abs(states - hf_states).max() <= ROUNDING * np.abs(hf_states).max()
    # token for token: a sample's rows in another's place (requests answered out of order) are far off
    assert np.abs(states[1:] - hf_states[:-1]).max() > 100 * ROUNDING * np.abs(hf_states).max()
