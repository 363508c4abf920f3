"""Run under `deepspeed --num_gpus 2` with TARGET STORE STAGE[,STAGE...]: for each ZeRO stage, one
optimizer step with uneven micro-batches per rank must produce the gradient of one big
single-process batch. Prints GRAD_MAX_ERR[STAGE]=<value> per stage (one launch for all of them:
each stage gets its own drafter, from the same seed, and its own engine)."""
import copy
import sys

import torch
import torch.distributed as dist

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
target_path, store_path, stages = args[0], args[1], [int(s) for s in args[2].split(",")]

import deepspeed  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from dflash.distributed.process_group import init_distributed  # noqa: E402
from dflash.models import BlockLoss, DFlashDrafter, DrafterConfig, TargetModel, default_gamma, ensure_mask_token  # noqa: E402,E501
from dflash.training.accumulate import accumulate_gradients  # noqa: E402
from dflash.training.ds_config import load_ds_config  # noqa: E402
from dflash.training.steps import MicroBatchMaker  # noqa: E402

init_distributed()
rank = dist.get_rank()
# SGD with a large step makes the update dominate the parameter, so before - after keeps
# the gradient's precision in fp32.
LR = 1e4
tok = AutoTokenizer.from_pretrained(target_path)
hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
target = TargetModel(hf, [1, 2], attention_backend="torch")
mask_id = ensure_mask_token(tok, target.num_embedding_rows)
config = DrafterConfig.from_target(hf.config, mask_token_id=mask_id, block_size=8, draft_layers=2,
                                   target_layer_ids=[1, 2], vocab_size=target.num_embedding_rows)
maker = MicroBatchMaker(store_path, "packed", pad_id=0, mask_token_id=mask_id, block_size=8, num_anchors=6,
                        gamma=default_gamma(8), seed=0)
per_rank = {0: [[0, 1, 2], [3]], 1: [[4], [5, 6]]}  # uneven micro-batches, same count per rank
micro = [maker(torch.tensor(ix).numpy(), epoch=0) for ix in per_rank[rank]]


def max_grad_error(stage: int) -> float | None:
    """The step's gradient under ZeRO `stage` against the single-process one (rank 0; None elsewhere)."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, target.shared_weights(), attention_backend="torch")
    reference = copy.deepcopy(drafter)
    reference.attach(target.shared_weights())
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    ds_config = load_ds_config("ds_configs/zero1.json", world_size=2, grad_clip=0.0, bf16=False)
    ds_config["zero_optimization"]["stage"] = stage
    ds_config["zero_allow_untested_optimizer"] = True  # plain SGD: the update is exactly -lr * grad
    engine, *_ = deepspeed.initialize(model=drafter, optimizer=torch.optim.SGD(drafter.parameters(), lr=LR),
                                      config=ds_config)
    accumulate_gradients(engine, target, BlockLoss(), micro, torch.device("cpu"), 8)
    engine.step()
    with deepspeed.zero.GatheredParameters(list(drafter.parameters()), enabled=stage == 3):
        ds_grad = {n: (before[n] - p.detach()) / LR for n, p in drafter.named_parameters()}
    if rank != 0:
        return None
    whole = maker(torch.arange(7).numpy(), epoch=0)
    hidden = reference(whole.batch, target.features(whole.batch), whole.blocks)
    out = BlockLoss()(hidden, whole.blocks, reference.lm_head)
    (out.loss_sum / out.weight_sum).backward()
    return max(float((ds_grad[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
               for n, p in reference.named_parameters())


for stage in stages:
    err = max_grad_error(stage)
    if rank == 0:
        print(f"GRAD_MAX_ERR[{stage}]={err:.3e}", flush=True)
    dist.barrier()
