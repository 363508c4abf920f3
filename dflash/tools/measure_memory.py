"""Check the memory plan against a real run: train a few steps and compare, on every rank, the
measured peak of tensor bytes with the plan's estimate for the micro-batches that ran.

Takes train.py's options (the run folder is overwritten); on the CPU the peak counts every tensor
storage alive after each op (`dflash.sizing.tensor_bytes`), the target's
parameters counted as loaded. Prints one JSON line per rank:
{"rank", "measured", "estimate", "error" (estimate / measured - 1), "tokens", "rows", "items"}.
Each `--sweep "FLAGS"` is one configuration, the options with FLAGS added (they win), measured in
turn in this one process (one launch: the imports and the process group paid once), each in its
own run folder under --output-dir, a target loaded once for the configurations that share its
options; its lines carry "sweep": FLAGS.

  deepspeed --num_gpus 2 launch/measure_memory.py --target T --data D --output-dir /tmp/m \\
      --token-budget 2048 --target-partition zero3 --measure-steps 3
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

from dflash.distributed.ranks import single_process_env  # noqa: E402
from dflash.errors import exit_on_user_error  # noqa: E402
from dflash.options import number, split_flags  # noqa: E402
from dflash.training.config import load_config  # noqa: E402


def _own_options(argv: list[str]) -> tuple[list[str], int, list[str]]:
    """(the trainer's options, --measure-steps, the --sweep configurations) of argv."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--measure-steps", dest="steps", type=number(int, minimum=1), default=3)
    own.add_argument("--sweep", action="append", default=[])
    args, rest = own.parse_known_args(argv)
    return rest, args.steps, args.sweep


def measure(cfg, target, steps: int) -> dict:
    """`steps` whole training steps of `cfg` with `target` (loaded, shared) against the plan: this
    rank's record (see the module's docstring), with the peaks by phase and the shapes that ran."""
    import torch.distributed as dist

    from dflash.distributed.partition import target_bytes
    from dflash.sizing.tensor_bytes import TensorBytes
    from dflash.training.memory_probe import PhaseMemory
    from dflash.training.trainer import Trainer

    loaded = target_bytes(target.model)
    seen = []
    with TensorBytes() as counter:
        trainer = Trainer(cfg, target=target)
        try:
            trainer.phases = PhaseMemory(trainer.device, trainer.models.drafter, counter)
            while trainer.step < steps:
                trainer.train_step()
                seen.extend(trainer.micro_batch_shapes)
        finally:
            trainer.close()
    measured = counter.peak + loaded["resident"] + loaded["shared"]
    plan = trainer.memory_plan
    tokens, rows, row_keys = max(seen, key=lambda shape: plan.peak(*shape)["total"])
    items = plan.peak(tokens, rows, row_keys)
    # the reserve is not tensors: the CPU check compares tensor bytes alone
    return {"rank": dist.get_rank(), "measured": measured, "estimate": items["total"],
            "error": items["total"] / measured - 1, "tokens": tokens, "rows": rows, "row_keys": row_keys,
            "items": items,
            "phases": {k: v + loaded["resident"] + loaded["shared"] for k, v in trainer.phases.peaks.items()},
            "shapes": seen}


@exit_on_user_error
def main(argv=None):
    argv, steps, sweep = _own_options(list(sys.argv[1:] if argv is None else argv))
    fixed = ["--overwrite", "--no-export", "--speculate-turns", "0", "--max-steps", str(steps),
             "--eval-every", str(10**6), "--checkpoint-every", str(10**6), "--no-progress"]
    configs = [(flags, load_config([*argv, *split_flags(flags, "--sweep"), *fixed], description=__doc__))
               for flags in sweep] or [(None, load_config([*argv, *fixed], description=__doc__))]
    single_process_env(os.environ, torch.cuda.device_count())

    from dflash.devices import resolve_dtype
    from dflash.distributed.process_group import init_distributed
    from dflash.target.spec import load_target_spec
    from dflash.training.data import chat_data
    from dflash.training.models import load_train_target

    init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    targets, records = {}, []
    for i, (flags, cfg) in enumerate(configs):
        if flags is not None:
            cfg = cfg.replace(output_dir=str(Path(cfg.run.output_dir) / f"sweep{i}"))
        d, dev = cfg.drafter, cfg.device
        key = (cfg.inputs.target, d.target_layer_ids, d.num_target_features, d.mask_token, dev.attention_backend,
               dev.dtype, dev.target_partition, dev.target_offload)
        if key not in targets:
            targets.clear()  # one target at a time: the last one's bytes are not this one's
            targets[key] = load_train_target(load_target_spec(cfg.inputs.target), device,
                                             resolve_dtype(dev.dtype, device), d, dev, chat_data(cfg.inputs))
        record = measure(cfg, targets[key], steps)
        if flags is not None:
            record = {"sweep": flags, **record}
        print(json.dumps(record), flush=True)
        records.append(record)
    return records if sweep else records[0]


if __name__ == "__main__":
    main()
