"""Tables and charts of `dflash.tools.compare`'s results (plain dicts keyed by mode): what
launch/compare_modes.py prints and plots, and the GPU check's end-to-end table."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash.tools.compare import COST, MODES

SEED_SHUFFLE_PADDED_RATIO = 0.37  # the seed's padded full shuffle vs its sorted batches (2.7x slower)
PHASE_COLUMNS = (("target", ("target_forward",)), ("drafter", ("drafter_forward", "drafter_backward")),
                 ("loss", ("loss",)), ("optim.", ("optimizer",)), ("other", ("other",)))


def _throughput_row(mode: str, s: dict) -> str:
    if "tokens_per_s" not in s:
        return f"{mode:<22} {s.get('skipped', 'not measured')}"
    row = (f"{mode:<22} {s['tokens_per_s']:>9,.0f} {s['computed_tokens_per_s']:>10,.0f} "
           f"{s['efficiency']:>7.1%} {s.get('epoch_efficiency', float('nan')):>7.1%} "
           f"{s.get('ratio_to_sorted_padded', float('nan')):>5.2f}x {s['steps']:>5} {s['step_seconds_median']:>7.3f} "
           f"{s['step_seconds_cv']:>7.1%} {s['rank_seconds_spread']:>11.1%} {s['wait_fraction']:>7.1%} "
           f"{s['micro_batches_per_step']:>7.1f}")
    if "phases" in s:
        shares = s["phases"]["shares"]
        row += "".join(f" {sum(shares[p] for p in parts):>7.1%}" for _, parts in PHASE_COLUMNS)
    return row + ("" if s.get("complete", True) else "  (pass cut short)")


def throughput_table(result: dict) -> str:
    head = (f"{'mode':<22} {'tokens/s':>9} {'computed/s':>10} {'effic.':>7} {'epoch':>7} {'ratio':>6} {'steps':>5} "
            f"{'step s':>7} {'step cv':>7} {'rank spread':>11} {'waiting':>7} {'mb/step':>7}")
    if any("phases" in s for s in result.values()):
        head += "".join(f" {name:>7}" for name, _ in PHASE_COLUMNS)
    lines = [head, "-" * len(head), *(_throughput_row(mode, s) for mode, s in result.items())]
    seen = next((s["lengths_seen"] for s in result.values() if "lengths_seen" in s), None)
    notes = []
    if seen:
        split = next(s["lengths_split"] for s in result.values() if "lengths_split" in s)
        notes.append(f"every mode: the same {seen['samples']:,} samples, {seen['tokens']:,} tokens (lengths mean "
                     f"{seen['mean']:.0f}, p10/p50/p90 {seen['p10']:.0f}/{seen['p50']:.0f}/{seen['p90']:.0f}; the "
                     f"split: mean {split['mean']:.0f}, {split['p10']:.0f}/{split['p50']:.0f}/{split['p90']:.0f}); "
                     "effic.: padding efficiency on them, epoch: planned over the whole split")
    if "ratio_to_sorted_padded" in result.get("shuffle-padded", {}):
        notes.append(f"shuffle-padded: {result['shuffle-padded']['ratio_to_sorted_padded']:.2f}x sorted-padded "
                     f"(the seed measured {SEED_SHUFFLE_PADDED_RATIO:.2f}x)")
    if all("tokens_per_s" in result.get(m, {}) for m in ("shuffle-packed", "sorted-packed")):
        ratio = result['shuffle-packed']['tokens_per_s'] / result['sorted-packed']['tokens_per_s']
        notes.append(f"shuffle-packed: {ratio:.3f}x sorted-packed")
    return "\n".join(lines + notes)


def convergence_table(result: dict) -> str:
    head = f"{'mode':<17} {'eval loss':>17} {'eval tau':>15} {'train s':>8} {'repeats':>7}"
    lines = [head, "-" * len(head)]
    for mode, s in result.items():
        lines.append(f"{mode:<17} {s['final_eval_loss_mean']:>8.4f} ± {s['final_eval_loss_std']:<6.4f} "
                     f"{s['final_eval_tau_mean']:>6.3f} ± {s['final_eval_tau_std']:<6.3f} "
                     f"{s['train_seconds_mean']:>8.1f} "
                     f"{len(s['repeats']):>7}")
    return "\n".join(lines)


def _colors(modes):
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    return {m: cmap(MODES.index(m.removesuffix(COST))) for m in modes}


def plot_throughput(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result)
    x = np.arange(len(modes))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    real = [result[m]["tokens_per_s"] for m in modes]
    ax.bar(x - 0.2, real, 0.4, label="real tokens/s")
    ax.bar(x + 0.2, [result[m]["computed_tokens_per_s"] for m in modes], 0.4, label="computed tokens/s", alpha=0.6)
    for i, m in enumerate(modes):
        if "ratio_to_sorted_padded" in result[m]:
            ax.text(i - 0.2, real[i], f"{result[m]['ratio_to_sorted_padded']:.2f}x", ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(x, modes, rotation=20)
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_convergence(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = _colors(result)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for mode, stats in result.items():
        for i, rep in enumerate(stats["repeats"]):
            label = mode if i == 0 else None
            for col, x in enumerate(("tokens_seen", "train_seconds")):
                color = colors[mode]
                axes[0, col].plot([s[x] for s in rep["train"]], [s["loss"] for s in rep["train"]], color=color,
                                  alpha=0.25, lw=0.8)
                axes[0, col].plot([e[x] for e in rep["eval"]], [e["loss"] for e in rep["eval"]], "o-", color=color,
                                  ms=3, lw=1.2, label=label)
                axes[1, col].plot([e[x] for e in rep["eval"]], [e["tau"] for e in rep["eval"]], "o-", color=color,
                                  ms=3, lw=1.2, label=label)
    for col, xlabel in enumerate(("real tokens seen", "training seconds")):
        axes[0, col].set(xlabel=xlabel, ylabel="loss (lines: eval; faint: train steps)")
        axes[1, col].set(xlabel=xlabel, ylabel="eval tau (offline acceptance length)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
