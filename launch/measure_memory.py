#!/usr/bin/env python
"""Check the memory plan against a real run: train a few steps and compare, on every rank, the
measured peak of tensor bytes with the plan's estimate for the micro-batches that ran.

Takes train.py's options (the run folder is overwritten); on the CPU the peak counts every tensor
storage alive after each op (`dflash.models.tensor_bytes`), the target's
parameters counted as loaded. Prints one JSON line per rank:
{"rank", "measured", "estimate", "error" (estimate / measured - 1), "tokens", "rows", "items"}.

  deepspeed --num_gpus 2 launch/measure_memory.py --target T --data D --output-dir /tmp/m \\
      --token-budget 2048 --target-partition zero3 --measure-steps 3
"""
import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

from dflash.distributed.ranks import single_process_env  # noqa: E402
from dflash.errors import exit_on_user_error  # noqa: E402
from dflash.options import number  # noqa: E402
from dflash.training.config import load_config  # noqa: E402


def _take(argv: list[str], flag: str, default: int) -> tuple[list[str], int]:
    """`flag N` taken out of argv (the rest are the trainer's options)."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument(flag, dest="value", type=number(int, minimum=1), default=default)
    args, rest = own.parse_known_args(argv)
    return rest, args.value


@exit_on_user_error
def main(argv=None):
    from dflash.models.tensor_bytes import TensorBytes
    from dflash.training.memory_probe import PhaseMemory

    argv, steps = _take(list(sys.argv[1:] if argv is None else argv), "--measure-steps", 3)
    cfg = load_config([*argv, "--overwrite", "--no-export", "--speculate-turns", "0", "--max-steps", str(steps),
                       "--eval-every", str(10**6), "--checkpoint-every", str(10**6), "--no-progress"],
                      description=__doc__)
    single_process_env(os.environ, torch.cuda.device_count())
    import torch.distributed as dist

    from dflash.devices import resolve_dtype
    from dflash.distributed.partition import target_bytes
    from dflash.distributed.process_group import init_distributed
    from dflash.models.target_spec import load_target_spec
    from dflash.training.models import load_train_target
    from dflash.training.trainer import Trainer

    init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dtype = resolve_dtype(cfg.device.dtype, device)
    target = load_train_target(cfg, load_target_spec(cfg.inputs.target), device, dtype)
    loaded = target_bytes(target.model)
    seen = []
    with TensorBytes() as counter:
        trainer = Trainer(cfg, target=target)
        trainer.phases = PhaseMemory(trainer.device, trainer.models.drafter, counter)
        while trainer.step < steps:
            trainer.train_step()
            seen.extend(trainer.micro_batch_shapes)
    measured = counter.peak + loaded["resident"] + loaded["shared"]
    plan = trainer.memory_plan
    tokens, rows, row_keys = max(seen, key=lambda shape: plan.peak(*shape)["total"])
    items = plan.peak(tokens, rows, row_keys)
    # the reserve is not tensors: the CPU check compares tensor bytes alone
    record = {"rank": dist.get_rank(), "measured": measured, "estimate": items["total"],
              "error": items["total"] / measured - 1, "tokens": tokens, "rows": rows, "row_keys": row_keys,
              "items": items,
              "phases": {k: v + loaded["resident"] + loaded["shared"] for k, v in trainer.phases.peaks.items()},
              "shapes": seen}
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
