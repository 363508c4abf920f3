"""Compare every batch order x layout (sorted, shuffle, bucketed; padded, packed) on the same
target, data and token budget: throughput by default, learning curves with --convergence.

  python launch/compare_modes.py [--target PATH --data PATH --steps N --deepspeed_config F] [--json]
  deepspeed --num_gpus N launch/compare_modes.py [...]          # several ranks

Every mode is timed on the same samples: a random subset of the training split holding about
--steps packed steps of tokens (or --subset-tokens), planned by each mode, so each sees a fair
sample of the epoch's lengths (a few steps of a whole sorted or bucketed epoch would hold only a
few lengths). Epoch 0 of the subset gives --warmup steps, left out; epoch 1 is timed whole. The
modes take their steps interleaved (step i of every mode, then step i + 1), each from the same
drafter initialisation, so drift of the machine hits them alike. Reports real and computed
tokens/s, padding efficiency (on the subset, and planned over the whole split), step-time spread
across steps and ranks, each mode's ratio to sorted-padded (the seed's batching), the lengths
every mode saw beside the split's, and with --time-phases the share of time in target forward,
drafter, loss, optimizer: a table, a PNG chart and, with --json, a JSON document on stdout keyed
"<order>-<layout>". --target random:qwen3-8b benchmarks the real shapes with no download.

--convergence trains every mode on the same number of real tokens and plots loss and offline
tau on the held-out split against tokens seen and training seconds, for --repeats seeds.

Modes may carry "+cost" (e.g. --modes shuffle-packed,shuffle-packed+cost): the same mode with
cost-balanced dealing to the ranks (--balance), so before and after are measured in one run; the
report gives the share of step time ranks wait for each other. Every micro-batch is timed, and
the cost model is fitted to the times (R^2, median error; calibration.json, and cost_model.json
for `train.py --balance --cost-model`).

With neither --target nor --data it runs the built-in CPU demo. All training options apply
(--token-budget, --step-tokens, --deepspeed_config, ...); --order and --layout are ignored.
Output goes to --output-dir (default runs/compare): <name>.png, <name>.json, one folder per mode.
"""
import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

from dflash.distributed.ranks import single_process_env  # noqa: E402
from dflash.errors import UserError, exit_on_user_error  # noqa: E402
from dflash.options import number
from dflash.training.config import build_parser, load_config  # noqa: E402


def add_compare_args(p):
    g = p.add_argument_group("comparison")
    g.add_argument("--modes", default="",
                   help="comma-separated modes to compare (default: all six, e.g. sorted-padded,shuffle-packed)")
    g.add_argument("--steps", type=number(int, minimum=1), default=None,
                   help="about this many measured optimizer steps per mode: every mode trains on the same random "
                        "samples, as many tokens as this many steps hold (default: 8; fewer samples make a noisy "
                        "ratio; --subset-tokens instead sets the tokens); with --convergence: the steps whose tokens "
                        "set the budget (default: 30)")
    g.add_argument("--warmup", type=number(int, minimum=0), default=1,
                   help="steps per mode left out of the throughput statistics, taken before the measured pass over "
                        "the same samples (default: 1)")
    g.add_argument("--convergence", action="store_true",
                   help="train every mode on the same real tokens and plot loss and tau curves instead of measuring "
                        "throughput")
    g.add_argument("--repeats", type=number(int, minimum=1), default=3,
                   help="--convergence: seeds per mode (--seed, --seed + 1, ...) to show the noise (default: 3)")
    g.add_argument("--eval-interval", type=number(int, minimum=1), default=5,
                   help="--convergence: evaluate every N steps per mode (default: 5)")
    g.add_argument("--json", action="store_true",
                   help="print the result as JSON on stdout (everything else goes to stderr)")
    return p


@exit_on_user_error
def main(argv=None):
    # plain `python`, no launcher: one rank of its own, on the first GPU if any
    single_process_env(os.environ, min(torch.cuda.device_count(), 1))
    argv = list(sys.argv[1:] if argv is None else argv)
    add_compare_args(build_parser(__doc__)).parse_args(argv)  # --help and bad flags, with every option
    # the comparison's own options; the rest are training options
    own = add_compare_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    args, cfg_argv = own.parse_known_args(argv)
    cfg = load_config(cfg_argv, description=__doc__)
    if cfg.run.output_dir == "runs/demo":  # the demo's default run folder: keep training runs apart
        cfg = cfg.replace(output_dir="runs/compare")
    steps = args.steps if args.steps is not None else (30 if args.convergence else 8)
    for flag, value, low in (("--steps", steps, 1), ("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1),
                             ("--eval-interval", args.eval_interval, 1)):
        if value < low:
            raise UserError(f"{flag}: must be >= {low}, got {value}")

    real_stdout = None
    if args.json:  # keep stdout for the JSON alone, whoever prints (DeepSpeed, C extensions)
        sys.stdout.flush()
        real_stdout = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    from pathlib import Path

    import torch.distributed as dist

    from dflash.tools import compare, compare_report

    modes = compare.parse_modes(args.modes)
    out = Path(cfg.run.output_dir)

    def say(text):
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(text, file=sys.stderr, flush=True)

    if args.convergence:
        result = compare.measure_convergence(cfg, modes, out, steps=steps, repeats=args.repeats,
                                             eval_every=args.eval_interval, say=say)
        name, table, plot = "convergence", compare_report.convergence_table(result), compare_report.plot_convergence
    else:
        result = compare.measure_throughput(cfg, modes, out, steps=steps, warmup=args.warmup, say=say)
        name, table, plot = "throughput", compare_report.throughput_table(result), compare_report.plot_throughput
    if dist.get_rank() == 0:
        title = (f"{name}: {dist.get_world_size()} rank(s), budget {cfg.batches.token_budget:,}, "
                 f"{cfg.batches.step_tokens:,} tokens/rank/step, {cfg.device.deepspeed_config}")
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out / f"{name}.png", title)
        say(f"{title}\n{table}\nwrote {out / name}.json and {out / name}.png")
        if real_stdout is not None:
            real_stdout.write(json.dumps(result) + "\n")
            real_stdout.flush()
    return result


if __name__ == "__main__":
    main()
