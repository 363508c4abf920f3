"""Run under `deepspeed --num_gpus 2` with STAGE[,STAGE...]: for each ZeRO stage, three optimizer
steps of `--optimizer muon` (the trainer's `engine_for` with `ds_config.with_optimizer`) on a small
module against a plain single-process reference: Muon (momentum, Nesterov, Newton-Schulz, step by
DeepSpeed's `muon_update`) for the matrix, torch's AdamW for the norm, both rates scaled by the
schedule, decoupled weight decay. Prints MUON_MAX_ERR[STAGE]=<matrix> <norm> and, to show the step
is Muon's and not SGD's, MUON_UPDATE_SV[STAGE]=<min> <max> of the first update's singular values
per unit of learning rate."""
import sys

import torch

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
stages = [int(s) for s in args[0].split(",")]

import deepspeed  # noqa: E402
from deepspeed.runtime.zero.muon.original_muon import muon_update  # noqa: E402

from dflash.distributed.process_group import init_distributed  # noqa: E402
from dflash.training.config import load_config  # noqa: E402
from dflash.training.ds_config import load_ds_config, with_optimizer  # noqa: E402
from dflash.training.models import engine_for, lr_lambda  # noqa: E402

init_distributed()
torch._dynamo.config.disable = True  # as engine_for does for Muon on CPU ranks: the reference's steps too
STEPS, TOTAL = 3, 4
cfg = load_config(["--data", "d.jsonl", "--optimizer", "muon", "--lr", "1e-3", "--muon-lr", "2e-2",
                   "--weight-decay", "0.1", "--warmup-ratio", "0.25", "--schedule", "cosine"])
x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))  # the same batch on both ranks


def module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.LayerNorm(48))


def reference():
    """Weights after STEPS steps, and the first Muon update per unit of learning rate."""
    m = module()
    weight, norm = m[0].weight, list(m[1].parameters())
    adam = torch.optim.AdamW(norm, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    scale = lr_lambda(cfg.optim.schedule, int(cfg.optim.warmup_ratio * TOTAL), TOTAL)
    momentum, first = torch.zeros_like(weight), None
    for step in range(STEPS):
        for g in adam.param_groups:
            g["lr"] = cfg.optim.lr * scale(step)
        m.zero_grad()
        m(x).pow(2).sum().backward()
        with torch.no_grad():
            update = muon_update(weight.grad.clone(), momentum, cfg.optim.muon_momentum)
            first = update if first is None else first
            lr = cfg.optim.muon_lr * scale(step)
            weight.mul_(1 - lr * cfg.optim.weight_decay).add_(update, alpha=-lr)
        adam.step()
    return m, first


want, first_update = reference()
for stage in stages:
    ds_config = load_ds_config(f"ds_configs/zero{stage}.json", world_size=2, grad_clip=cfg.optim.grad_clip, bf16=False)
    o = cfg.optim
    ds_config = with_optimizer(ds_config, o.optimizer, lr=o.lr, muon_lr=o.muon_lr, momentum=o.muon_momentum,
                               weight_decay=o.weight_decay, named="test")
    got = module()
    engine, optimizer, scheduler = engine_for(got, ds_config, cfg.optim, TOTAL, "cpu")
    for _ in range(STEPS):
        engine.backward(engine(x).pow(2).sum() / 2)  # the two ranks' mean is one rank's loss
        engine.step()
    with deepspeed.zero.GatheredParameters(list(got.parameters()), enabled=stage == 3), torch.no_grad():
        errors = [float((g - w).abs().max() / (w - s).abs().max())
                  for g, w, s in zip(got.parameters(), want.parameters(), module().parameters(), strict=True)]
    if torch.distributed.get_rank() == 0:
        print(f"MUON_MAX_ERR[{stage}]={errors[0]:.3e} {max(errors[1:]):.3e}", flush=True)
sv = torch.linalg.svdvals(first_update)[:x.shape[0]]  # the gradient's rank is the batch's 16 rows
if torch.distributed.get_rank() == 0:
    print(f"MUON_UPDATE_SV={float(sv.min()):.3f} {float(sv.max()):.3f}", flush=True)
