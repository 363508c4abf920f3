"""The public names of the drafter, target and objective rooms (`dflash.drafter`, `dflash.target`,
`dflash.objective`) in one import: the frozen target feature extractor and the DFlash drafter.

    target = TargetModel(hf_causal_lm)                     # frozen, eval, no grad
    config = DrafterConfig.from_target(hf_causal_lm.config, mask_token_id=mask_id)
    drafter = DFlashDrafter(config, target.shared_weights())
    blocks = draw_blocks(batch, block_size=B, num_anchors=512, mask_token_id=mask_id,
                         slot_weights=slot_weights(B, gamma), seed=seed, epoch=epoch)
    out = BlockLoss()(drafter(batch, target.features(batch), blocks), blocks, drafter.lm_head)
    drafter.save_pretrained(path)                          # official DFlash checkpoint format
"""
from dflash.data.vocab import MASK_TOKEN, ensure_mask_token
from dflash.drafter.config import DrafterConfig
from dflash.drafter.config_format import CONFIG_KEYS
from dflash.drafter.network import DFlashDrafter, DrafterCache
from dflash.objective.anchors import Anchors, BlockTensors, block_tensors, sample_anchors, to_packed
from dflash.objective.blocks import Blocks, draw_blocks
from dflash.objective.loss import (
    BlockLoss,
    LogitTerm,
    LossOutput,
    acceptance_stats,
    chunked_loss,
    chunked_weighted_ce,
    default_gamma,
    slot_weights,
)
from dflash.target.model import SharedWeights, TargetModel, load_language_model
from dflash.target.spec import TARGET_FAMILIES, TargetSpec, load_target_spec
from dflash.target.taps import check_target_layer_ids, default_target_layer_ids

__all__ = [
    "Anchors",
    "BlockLoss",
    "BlockTensors",
    "Blocks",
    "CONFIG_KEYS",
    "DFlashDrafter",
    "DrafterCache",
    "DrafterConfig",
    "LogitTerm",
    "LossOutput",
    "MASK_TOKEN",
    "SharedWeights",
    "TARGET_FAMILIES",
    "TargetModel",
    "TargetSpec",
    "acceptance_stats",
    "block_tensors",
    "check_target_layer_ids",
    "chunked_loss",
    "chunked_weighted_ce",
    "default_gamma",
    "default_target_layer_ids",
    "draw_blocks",
    "ensure_mask_token",
    "load_language_model",
    "load_target_spec",
    "sample_anchors",
    "slot_weights",
    "to_packed",
]
