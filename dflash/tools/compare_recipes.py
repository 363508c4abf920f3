#!/usr/bin/env python
"""Compare training recipes (objective, learning rate and schedule, feature noise) by the held-out acceptance that
decoding measures: every recipe trains on the same target, data, steps and seeds, the recipes' steps
interleaved (step i of every recipe, then i + 1) so drift of the machine hits them alike, and each is
evaluated by the eval walk (greedy tau, and tau@T at --eval-temperatures, default 0,1) before the
first step, every --eval-interval steps and at the end.

  python launch/compare_recipes.py [training options] [--recipes "name: flags ; ..."] [--steps N] [--seeds 0,1]
  deepspeed --num_gpus N launch/compare_recipes.py [...]          # several ranks

A recipe is a name and the training flags that make it, on top of the options every recipe shares
(the demo's own recipe is speculators' at a constant rate: spell a recipe whole), e.g.
  --recipes "ce: --loss ce=1 --feature-noise 0 --optimizer adamw --schedule cosine ; lk: --loss ce=0.5,lk=1
  --feature-noise 0 --optimizer adamw --schedule cosine"
(default: ce, dpace, kl, lk, noise, muon, and speculators' recipe: CE + D-PACE with noise 0.05 and Muon,
at the cosine schedule; and speculators' recipe at a constant rate, the demo's). A recipe may set only
--loss, --dpace-alpha, --distill-temperature, --optimizer, --lr, --muon-lr, --muon-momentum,
--weight-decay, --warmup-ratio, --schedule, --grad-clip, --gamma, --feature-noise, and the drafter's
kind (--drafter-kind, the kind's own options, --drafter-layer-types, --sliding-window: kinds against each
other, e.g. --recipes "dflash: ; other: --drafter-kind K"); every other option
is given once and shared.
With neither --target nor --data it runs the built-in CPU demo.
Output in --output-dir (default runs/recipes): recipes.json, recipes.png (tau and tau@T against
steps and training seconds, a line per seed), one run folder per seed and recipe.
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
from dflash.options import number, parse_list  # noqa: E402
from dflash.training.config import build_parser  # noqa: E402


def add_recipe_args(p):
    from dflash.tools.recipes import DEFAULT_RECIPES

    g = p.add_argument_group("comparison")
    g.add_argument("--recipes", default=DEFAULT_RECIPES,
                   help="'name: flags ; name: flags ...', the training flags of each recipe (default: "
                        f"{DEFAULT_RECIPES!r})")
    g.add_argument("--steps", type=number(int, minimum=1), default=200,
                   help="optimizer steps per recipe and seed; the schedule spans them (default: 200)")
    g.add_argument("--seeds", default="0,1",
                   help="comma-separated seeds, at least 2: each recipe trains once per seed (default: 0,1)")
    g.add_argument("--eval-interval", type=number(int, minimum=1), default=25,
                   help="evaluate every recipe every N steps (default: 25)")
    return p


@exit_on_user_error
def main(argv=None):
    # plain `python`, no launcher: one rank of its own, on the first GPU if any
    single_process_env(os.environ, min(torch.cuda.device_count(), 1))
    argv = list(sys.argv[1:] if argv is None else argv)
    add_recipe_args(build_parser(__doc__)).parse_args(argv)  # --help and bad flags, with every option
    own = add_recipe_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    args, cfg_argv = own.parse_known_args(argv)
    seeds = parse_list(args.seeds, "--seeds", distinct=True, minimum=0)
    if len(seeds) < 2:
        raise UserError(f"--seeds: give at least 2 seeds (the spread between seeds is the noise a difference must "
                        f"beat), got {args.seeds}")
    from pathlib import Path

    import torch.distributed as dist

    from dflash.tools import recipes as rec

    recipes = rec.parse_recipes(args.recipes, cfg_argv)
    if next(iter(recipes.values())).run.output_dir == "runs/demo":  # the demo's default run folder: keep runs apart
        recipes = {name: c.replace(output_dir="runs/recipes") for name, c in recipes.items()}
    base = next(iter(recipes.values()))
    out = Path(base.run.output_dir)

    def say(text):
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(text, file=sys.stderr, flush=True)

    result = rec.compare_recipes(recipes, out, steps=args.steps, seeds=list(seeds), eval_every=args.eval_interval,
                                 say=say)
    if dist.get_rank() == 0:
        title = (f"recipes: {dist.get_world_size()} rank(s), {args.steps} steps, seeds {args.seeds}, budget "
                 f"{base.batches.token_budget:,}, {base.batches.step_tokens:,} tokens/rank/step, "
                 f"{base.device.deepspeed_config}")
        (out / "recipes.json").write_text(json.dumps({"title": title, "recipes": {
            name: {"flags": flags, **result[name]} for name, flags in _flags(args.recipes).items()}}, indent=1) + "\n")
        rec.plot_recipes(result, out / "recipes.png", title)
        say(f"{title}\n{rec.recipes_table(result)}\nwrote {out / 'recipes.json'} and {out / 'recipes.png'}")
    return result


def _flags(text: str) -> dict:
    return {name.strip(): flags.strip() for name, _, flags in
            (item.partition(":") for item in text.split(";") if item.strip())}


if __name__ == "__main__":
    main()
