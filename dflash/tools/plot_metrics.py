"""Plot a training run: loss and acceptance length tau against the step (or the training time),
train and held out.

  python launch/plot_metrics.py runs/demo [--output runs/demo/curves.png] [--x seconds]

Reads RUN/metrics.jsonl (written by launch/train.py) and writes a PNG with two panels. Steps
skipped for non-finite values leave gaps.
"""
import argparse
import sys
from pathlib import Path

from dflash.errors import UserError, exit_on_user_error
from dflash.training.metrics import plot_curves, read_records


@exit_on_user_error
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the output dir of launch/train.py")
    p.add_argument("--output", default="", help="PNG to write (default: RUN/curves.png)")
    p.add_argument("--title", default="", help="figure title (default: the run folder)")
    p.add_argument("--x", choices=("step", "seconds"), default="step",
                   help="the x axis: the optimizer step, or the training time so far (the steps' own seconds, "
                        "evaluations left out; drawn in minutes)")
    args = p.parse_args(argv)
    run = Path(args.run)
    records = read_records(run)
    if not any(r["kind"] == "train" for r in records):
        raise UserError(f"{run / 'metrics.jsonl'}: no training records yet")
    output = Path(args.output or run / "curves.png")
    plot_curves(records, output, args.title or str(run), x=args.x)
    print(f"wrote {output}")


if __name__ == "__main__":
    main(sys.argv[1:])
