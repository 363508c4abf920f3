"""The tiny Qwen3 target, packed batches and block runs of the drafter tests (test_drafter, test_dflash2)."""
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from dflash.data.batch import PackedBatch
from dflash.models import TargetModel, block_tensors
from dflash.testing import tiny_qwen3_config

VOCAB, MASK_ID, B = 300, 299, 4
TAPS = [1, 3]


def tiny_target(seed=0):
    torch.manual_seed(seed)
    config = tiny_qwen3_config(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return TargetModel(AutoModelForCausalLM.from_config(config).float(), TAPS)


def make_batch(lengths, seed=0, prompt=5):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB - 1, (n,), generator=g) for n in lengths]
    masks = [torch.arange(n) >= prompt for n in lengths]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return PackedBatch(torch.cat(ids), torch.cat(masks), torch.cat([torch.arange(n) for n in lengths]), cu,
                       cu.clone(), max(lengths), torch.arange(len(lengths)))


def run_blocks(drafter, batch, feats, anchors):
    bt = block_tensors(anchors, batch, MASK_ID)
    hidden = drafter.block_hidden(feats, bt.input_ids, bt.position_ids, batch.position_ids,
                                  (batch.cu_seqlens, batch.cu_seqlens_cpu), anchors)
    return hidden.view(-1, B, hidden.shape[-1])
