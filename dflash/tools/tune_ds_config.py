"""Tune a DeepSpeed JSON on the real job: short training trials ranked by real tokens/s.

  python launch/tune_ds_config.py --base ds_configs/zero2.json [search space] [-- training options]

Every combination of --stages x --token-budgets x --micro-batches x --offload x
--activation-checkpointing is one `launch/train.py` run on --num-ranks ranks: --warmup steps,
then --steps measured steps, in real tokens/s (not samples/s: variable-length samples are no
unit of work). A trial that runs out of memory is recorded as such and the sweep goes on. The
shipped ds_configs/*.json run as trials too (at the first budget and micro-batch count), so
the table shows the choice against them. Writes the fastest as a ready DeepSpeed JSON
(--output) with the token budget and step tokens to train with, plus summary.json and the
table in --workdir.

Options after `--` (or unknown ones) go to launch/train.py unchanged (--target, --data, model
sizes); with neither --target nor --data the trials train the CPU demo. Meant for GPUs; works
on the CPU with small sizes.
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

from dflash.errors import UserError, exit_on_user_error
from dflash.options import number, parse_list
from dflash.tools import tune
from dflash.training.ds_config import load_ds_config, resolve_ds_config, shipped_ds_configs


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--base", default="ds_configs/zero2.json",
                   help="DeepSpeed JSON the trials start from (default: ds_configs/zero2.json)")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages to try (default: 1,2,3)")
    p.add_argument("--token-budgets", default="2048,4096",
                   help="tokens per micro-batch to try (default: 2048,4096, CPU-sized)")
    p.add_argument("--micro-batches", default="1,2",
                   help="micro-batches per optimizer step to try: step tokens = this x budget (default: 1,2)")
    p.add_argument("--offload", default="none",
                   help="optimizer (and ZeRO-3 parameter) offload to try: none, cpu or none,cpu (default: none)")
    p.add_argument("--activation-checkpointing", default="off",
                   help="drafter activation checkpointing to try: off, on or off,on (default: off)")
    p.add_argument("--no-defaults", action="store_true",
                   help="do not run the shipped ds_configs/*.json as reference trials")
    p.add_argument("--num-ranks", type=number(int, minimum=1), default=1,
                   help="ranks per trial (deepspeed --num_gpus) (default: 1)")
    p.add_argument("--steps", type=number(int, minimum=1), default=8,
                   help="measured steps per trial, after the warm-up (default: 8)")
    p.add_argument("--warmup", type=number(int, minimum=0), default=2,
                   help="steps per trial left out of the measurement (default: 2)")
    p.add_argument("--timeout", type=number(float, above=0), default=900,
                   help="seconds after which a trial is stopped and recorded as an error (default: 900)")
    p.add_argument("--workdir", default="runs/tune", help="trial folders, logs, summary.json (default: runs/tune)")
    p.add_argument("--output", default="",
                   help="where to write the best DeepSpeed JSON (default: WORKDIR/best_ds_config.json)")
    return p


@exit_on_user_error
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
        args = build_parser().parse_args(argv)
    else:
        args, train_args = build_parser().parse_known_args(argv)
    for flag, value, low in (("--num-ranks", args.num_ranks, 1), ("--steps", args.steps, 1),
                             ("--warmup", args.warmup, 0)):
        if value < low:
            raise UserError(f"{flag}: must be >= {low}, got {value}")
    offloads = parse_list(args.offload, "--offload", str)
    if set(offloads) - {"none", "cpu"}:
        raise UserError(f"--offload: expected none and/or cpu, got {args.offload!r}")
    load_ds_config(args.base, world_size=1, grad_clip=1.0, bf16=False, flag="--base")  # one the trainer can run
    base = json.loads(resolve_ds_config(args.base).read_text())
    budgets = parse_list(args.token_budgets, "--token-budgets", minimum=1)
    micro = parse_list(args.micro_batches, "--micro-batches", minimum=1)
    checkpointing = parse_list(args.activation_checkpointing, "--activation-checkpointing", str)
    if set(checkpointing) - {"off", "on"}:
        raise UserError(f"--activation-checkpointing: expected off and/or on, got {args.activation_checkpointing!r}")
    stages = parse_list(args.stages, "--stages")
    if set(stages) - {1, 2, 3}:
        raise UserError(f"--stages: ZeRO stages 1, 2 and/or 3, got {args.stages!r}")
    trials = tune.search_space(base, stages, budgets, micro, offloads,
                               [c == "on" for c in checkpointing])
    if not args.no_defaults:
        trials += [tune.Trial(f"default:{p.stem}", json.loads(p.read_text()), budgets[0], micro[0])
                   for p in sorted(shipped_ds_configs().glob("*.json"))]
    workdir = Path(args.workdir)
    for i, trial in enumerate(trials):
        print(f"[{i + 1}/{len(trials)}] {trial.name} ...", file=sys.stderr, flush=True)
        tune.run_trial(trial, train_args, workdir, num_ranks=args.num_ranks, steps=args.steps, warmup=args.warmup,
                       timeout=args.timeout)
        print(f"    {trial.status} {trial.tokens_per_s:,.0f} tokens/s {trial.detail}", file=sys.stderr, flush=True)
    table = tune.summary_table(trials)
    winner = tune.best(trials)
    output = Path(args.output or workdir / "best_ds_config.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(winner.ds_config, indent=2) + "\n")
    (workdir / "summary.json").write_text(json.dumps([dataclasses.asdict(t) for t in trials], indent=1) + "\n")
    (workdir / "summary.txt").write_text(table + "\n")
    print(table)
    print(f"best: {winner.name}, {winner.tokens_per_s:,.0f} real tokens/s -> {output}\n"
          f"train with: --deepspeed_config {output} --token-budget {winner.token_budget} "
          f"--step-tokens {winner.micro_batches * winner.token_budget}"
          f"{' --activation-checkpointing' if winner.activation_checkpointing else ''}")


if __name__ == "__main__":
    main()
