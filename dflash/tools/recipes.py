"""Recipes compared by what decoding accepts: several training recipes (objective, learning rate, noise)
on the same target, data, steps and seeds, their optimizer steps interleaved, each evaluated on the
held-out split by the eval walk (greedy tau: what greedy speculative decoding reaches, and tau@T:
the expected acceptance of speculative sampling at T) against steps and training seconds.

One process loads the target once; for each seed every recipe gets a `Trainer` whose drafter starts
from that seed, and the recipes take their steps round-robin (step i of every recipe, then i + 1),
so drift of the machine hits them alike. Only recipe options (`RECIPE_FIELDS`) and the drafter's
kind (`DRAFTER_FIELDS` and the kinds' own options: the kind, its options and its layers; a kind whose
new parts start as identities starts from the seed's DFlash drafter) may differ between recipes: the
data, the batching, the schedule length and the drafter's sizes are the same.
"""
from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np

from dflash.errors import UserError
from dflash.options import split_flags
from dflash.training.config import OPTIONS, TrainConfig, load_config
from dflash.training.config.sections import KIND_OPTIONS, TERM_OPTIONS
from dflash.training.trainer import Trainer

# what a recipe may set: the objective, the optimizer's settings and its schedule's shape, the noise
RECIPE_FIELDS = ("loss", *TERM_OPTIONS, "optimizer", "lr", "muon_lr", "muon_momentum",
                 "weight_decay", "warmup_ratio", "schedule", "grad_clip", "gamma", "feature_noise")
# drafter kinds against each other: the kind, its own options (`compared`), and the layers a kind may bring
# as released
DRAFTER_FIELDS = ("drafter_kind", "drafter_layer_types", "sliding_window")


def compared() -> tuple[str, ...]:
    """What a recipe may set: `RECIPE_FIELDS`, `DRAFTER_FIELDS` and every registered kind's own options."""
    return (*RECIPE_FIELDS, *DRAFTER_FIELDS, *KIND_OPTIONS)

# each recipe whole, as the demo's own default is speculators' recipe at a constant rate: the
# cross-entropy with AdamW, one change at a time, speculators' recipe, and it at a constant rate
DEFAULT_RECIPES = ("ce: --loss ce=1 --feature-noise 0 --optimizer adamw --schedule cosine ; "
                   "dpace: --loss ce=1,dpace=0.5 --feature-noise 0 --optimizer adamw --schedule cosine ; "
                   "kl: --loss ce=0.5,kl=1 --feature-noise 0 --optimizer adamw --schedule cosine ; "
                   "lk: --loss ce=0.5,lk=1 --feature-noise 0 --optimizer adamw --schedule cosine ; "
                   "noise: --loss ce=1 --feature-noise 0.05 --optimizer adamw --schedule cosine ; "
                   "muon: --loss ce=1 --feature-noise 0 --optimizer muon --schedule cosine ; "
                   "speculators: --loss ce=1,dpace=0.5 --feature-noise 0.05 --optimizer muon --schedule cosine ; "
                   "speculators_const: --loss ce=1,dpace=0.5 --feature-noise 0.05 --optimizer muon --schedule constant")


def parse_recipes(text: str, base_argv: list[str]) -> dict[str, TrainConfig]:
    """`name: flags ; name: flags ...` -> {name: the base options with the recipe's flags on top}.
    A recipe that sets anything but `compared()`, or a bad flag, is refused naming the recipe."""
    base = load_config(base_argv)
    recipes: dict[str, TrainConfig] = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, flags = item.partition(":")
        name = name.strip()
        if not sep or not name:
            raise UserError(f"--recipes: {item!r} is not 'name: flags' (e.g. 'dpace: --loss ce=1,dpace=0.5')")
        if name in recipes:
            raise UserError(f"--recipes: {name} is given twice")
        argv = split_flags(flags, f"--recipes {name}")
        try:
            cfg = load_config([*base_argv, *argv])
        except UserError as e:
            raise UserError(f"--recipes {name}: {e}") from None
        allowed = compared()
        changed = [name for name in OPTIONS if name not in allowed and cfg.value(name) != base.value(name)]
        if changed:
            raise UserError(f"--recipes {name}: sets {', '.join('--' + c.replace('_', '-') for c in changed)}, "
                            f"which every recipe shares (give it once, outside --recipes); a recipe sets only "
                            f"{', '.join('--' + c.replace('_', '-') for c in allowed)}")
        recipes[name] = cfg
    if len(recipes) < 1:
        raise UserError("--recipes: no recipe given")
    return recipes


class RecipeRun:
    """One recipe and seed: its trainer, stepped one optimizer step at a time, and its evaluations."""

    def __init__(self, name: str, trainer: Trainer):
        self.name, self.trainer = name, trainer
        self.steps, self.train_seconds = 0, 0.0
        self.evals: list[dict] = []

    def step(self) -> None:
        record = self.trainer.train_step()  # a record every step: the runs are built with log_every=1
        self.steps += 1
        self.train_seconds += record["step_seconds"]

    def evaluate(self) -> None:
        e = self.trainer.evaluate()
        if e is not None:
            self.evals.append({"step": self.steps, "train_seconds": self.train_seconds, "loss": e["loss"],
                               "tau": e["tau"], **{k: v for k, v in e.items() if k.startswith("tau@")}})


def build_runs(recipes: dict[str, TrainConfig], seed: int, out: Path, steps: int, target=None,
               data: str | None = None) -> list[RecipeRun]:
    """A trainer per recipe for `seed`, all sharing one loaded target and one token store (`data`: the
    store an earlier run prepared)."""
    runs = []
    for name, cfg in recipes.items():
        run_cfg = cfg.replace(seed=seed, output_dir=str(out / f"seed{seed}" / name), max_steps=steps,
                                      export=False, progress=False, resume=False, overwrite=True, stop_at_step=0,
                                      log_every=1, eval_every=0, speculate_turns=0, **({"data": data} if data else {}))
        runs.append(RecipeRun(name, Trainer(run_cfg, target=target)))
        target = runs[0].trainer.models.target
        data = str(runs[0].trainer.data.store_path)  # a JSONL file is prepared once, for all recipes
    return runs


def compare_recipes(recipes: dict[str, TrainConfig], out: Path, *, steps: int, seeds: list[int],
                    eval_every: int, say) -> dict:
    """Every recipe for every seed, `steps` optimizer steps each, interleaved; the eval walk before the
    first step, every `eval_every` steps and at the end. Returns {recipe: {"seeds": [...], "final": ...}}."""
    result = {name: {"seeds": []} for name in recipes}
    target = data = None
    for seed in seeds:
        runs = build_runs(recipes, seed, out, steps, target, data)
        target, data = runs[0].trainer.models.target, str(runs[0].trainer.data.store_path)
        todo = runs[0].trainer.data.total_steps  # --epochs may hold fewer steps than asked; the same for all
        say(f"seed {seed}: {len(runs)} recipes ({', '.join(recipes)}), {todo} steps each, interleaved")
        for r in runs:
            r.evaluate()
        started = time.perf_counter()
        while runs[0].steps < todo:
            for r in runs:
                r.step()
            if runs[0].steps % eval_every == 0 or runs[0].steps == todo:
                for r in runs:
                    r.evaluate()
                say(f"  step {runs[0].steps}: " + ", ".join(f"{r.name} tau {r.evals[-1]['tau']:.3f}" for r in runs))
        for r in runs:
            result[r.name]["seeds"].append({"seed": seed, "evals": r.evals})
            r.trainer.close()
        say(f"seed {seed} done in {time.perf_counter() - started:.0f}s")
        del runs
        gc.collect()
    summarise(result)
    return result


def summarise(result: dict) -> None:
    """Add to every recipe `final` (mean and std over seeds of the last evaluation: equal steps) and
    `equal_time`: tau and tau@T at the training seconds every recipe of the seed reached (the fastest
    one's total), each recipe's curve interpolated linearly between its evaluations."""
    names = list(result)
    first = result[names[0]]["seeds"][0]["evals"][-1]
    # tau@0 is the greedy tau
    keys = [k for k in first if k == "tau" or k.startswith("tau@") and k != "tau@0" and "_" not in k]
    budgets = [min(result[n]["seeds"][i]["evals"][-1]["train_seconds"] for n in names)
               for i in range(len(result[names[0]]["seeds"]))]

    def mean_std(values):
        return {"mean": float(np.mean(values)), "std": float(np.std(values))}

    for stats in result.values():
        finals = [s["evals"][-1] for s in stats["seeds"]]
        stats["final"] = {k: mean_std([f[k] for f in finals]) for k in [*keys, "loss", "train_seconds"]}
        at = [{k: float(np.interp(budget, [e["train_seconds"] for e in s["evals"]], [e[k] for e in s["evals"]]))
               for k in keys} for s, budget in zip(stats["seeds"], budgets, strict=True)]
        stats["equal_time"] = {"train_seconds": mean_std(budgets), **{k: mean_std([a[k] for a in at]) for k in keys}}


def recipes_table(result: dict) -> str:
    """Mean ± std over seeds: tau and tau@T after the same steps, the held-out CE and the training
    seconds; then tau and tau@T at equal training seconds (`summarise`)."""
    keys = [k for k in next(iter(result.values()))["final"] if k not in ("loss", "train_seconds")]
    width = max(14, *(len(name) + 2 for name in result))  # the names' column: as wide as the longest name
    head = f"{'recipe':<{width}}" + "".join(f"{k:>18}" for k in keys) + f"{'eval CE':>17}{'train s':>9}{'seeds':>6}" \
        + "".join(f"{k + ' @equal s':>20}" for k in keys)
    lines = [head, "-" * len(head)]
    for name, s in result.items():
        f, e = s["final"], s["equal_time"]
        lines.append(f"{name:<{width}}" + "".join(f"{f[k]['mean']:>10.3f} ± {f[k]['std']:<5.3f}" for k in keys)
                     + f"{f['loss']['mean']:>9.4f} ± {f['loss']['std']:<5.3f}{f['train_seconds']['mean']:>9.1f}"
                     + f"{len(s['seeds']):>6}" + "".join(f"{e[k]['mean']:>12.3f} ± {e[k]['std']:<5.3f}" for k in keys))
    budget = next(iter(result.values()))["equal_time"]["train_seconds"]["mean"]
    return "\n".join([*lines, f"@equal s: at the training seconds every recipe reached in a seed (the fastest "
                                f"one's total; mean {budget:.1f} s), interpolated between evaluations"])


def plot_recipes(result: dict, path: Path, title: str) -> None:
    """Held-out tau and tau@T against steps and training seconds, one colour per recipe, a line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in next(iter(result.values()))["final"] if k not in ("loss", "train_seconds")]
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.6 * len(keys)), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for i, (name, stats) in enumerate(result.items()):
        for j, run in enumerate(stats["seeds"]):
            for row, key in enumerate(keys):
                for col, x in enumerate(("step", "train_seconds")):
                    axes[row, col].plot([e[x] for e in run["evals"]], [e[key] for e in run["evals"]], "o-",
                                        color=cmap(i % 10), ms=3, lw=1, alpha=0.8, label=name if j == 0 else None)
    for row, key in enumerate(keys):
        what = "greedy tau (eval walk)" if key == "tau" else f"{key} (expected acceptance at T)"
        axes[row, 0].set(xlabel="optimizer steps", ylabel=what)
        axes[row, 1].set(xlabel="training seconds", ylabel=what)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
