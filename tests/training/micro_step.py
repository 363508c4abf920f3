"""One training micro-step of a tiny target and drafter, its peak tensor bytes measured after every op and
the memory plan's estimate of it: the plan's check against a measured peak, shared by the memory tests
(tests/sizing/test_memory.py) and the drafter kinds' conformance suite (tests/drafter/test_kind_conformance.py)."""
import torch
from transformers import AutoModelForCausalLM

from dflash.data.batch import PackedBatch
from dflash.drafter.network import drafter_class
from dflash.models import DrafterConfig, TargetModel, draw_blocks, slot_weights
from dflash.objective.terms import needs_target_states, target_context
from dflash.sizing.memory import DrafterSizes, MemoryPlan, MemorySetup, target_sizes
from dflash.sizing.tensor_bytes import measure_peak_tensor_bytes
from dflash.testing import tiny_qwen3_config
from dflash.training.config import load_config
from dflash.training.models import drafter_kind_settings, training_loss
from dflash.training.plan import loss_setup, resolve_run


def planned_and_measured_micro_step(dtype, checkpointing: bool, recipe: str, kind: str, settings=None):
    """(the plan's estimate, the measured peak, the plan, the loss) of one micro-step: features, drafter
    forward and backward through the Triton kernels (the GPU's path; on the CPU in the interpreter), with
    the objective of `recipe` (its terms' vocabulary buffers, the target's final states for KL and LK) and a
    drafter of `kind` (its `settings`; None: as released)."""
    torch.manual_seed(0)
    config = tiny_qwen3_config(vocab_size=512, intermediate_size=192, num_hidden_layers=3, max_position_embeddings=1024)
    target = TargetModel(AutoModelForCausalLM.from_config(config).to(dtype), [0, 1], attention_backend="triton")
    dcfg = DrafterConfig.from_target(config, mask_token_id=511, draft_layers=2, target_layer_ids=[0, 1],
                                     **drafter_kind_settings(kind, settings))
    drafter = drafter_class(dcfg)(dcfg, target.shared_weights(), attention_backend="triton",
                                  activation_checkpointing=checkpointing).to(dtype)
    lengths = [150, 100]
    cu = torch.tensor([0, 150, 250], dtype=torch.int32)
    batch = PackedBatch(input_ids=torch.randint(0, 500, (250,)), loss_mask=torch.ones(250, dtype=torch.bool),
                        position_ids=torch.cat([torch.arange(n) for n in lengths]), cu_seqlens=cu,
                        cu_seqlens_cpu=cu.clone(), max_seqlen=150, sample_ids=torch.arange(2))
    blocks = draw_blocks(batch, block_size=16, num_anchors=8, mask_token_id=511, slot_weights=slot_weights(16, 7.0),
                         seed=0, epoch=0)

    cfg = load_config(["--data", "d.jsonl", "--loss", recipe, "--block-size", "16", "--drafter-kind", kind])
    loss = training_loss(cfg.loss, cfg.drafter.block_size, drafter)

    def step():
        context = None
        if needs_target_states(loss):
            features, states = target.features(batch, with_output=True)
            context = target_context(states, batch)
        else:
            features = target.features(batch)
        loss(drafter(batch, features, blocks), blocks, drafter.lm_head, context=context).loss_sum.backward()

    measured, _ = measure_peak_tensor_bytes(step)
    plan = MemoryPlan(target_sizes(config), DrafterSizes.from_target(
        config, layers=2, features=2, kind=dcfg.kind, kind_settings=dcfg.kind_settings),
                      MemorySetup(dtype_bytes=dtype.itemsize, num_anchors=8, activation_checkpointing=checkpointing,
                                  **loss_setup(resolve_run(cfg))))
    tokens, rows = 250, blocks.num_blocks * 16
    return max(plan.target_phase(tokens), plan.drafter_phase(tokens, rows)), measured, plan, loss
