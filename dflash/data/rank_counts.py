"""Equal micro-batch counts on every rank: ZeRO-3 needs every rank to run the same number of forward
passes, so a plan whose count does not divide by the world size is evened out without dropping or
repeating a sample (splits of the fullest micro-batches, or merges of ones that fit together)."""
from __future__ import annotations

import numpy as np

from dflash.errors import UserError

MERGE_STATES = 20_000  # sets of unions the merge search visits before it gives up (and says so)


def equal_counts(batches: list, lengths: np.ndarray, token_budget: int, layout: str, world_size: int,
                 rows: np.ndarray | None = None, row_budget: int | None = None) -> list:
    """Make the batch count divisible by world_size without dropping or repeating a sample.

    ZeRO-3 needs every rank to run the same number of forward passes. The batches with the
    most samples are split in two (never over budget); when there are too few samples to
    split, batches are merged instead, if they fit together (see `_merge`).
    """
    batches = list(batches)
    splits = -len(batches) % world_size
    if int(lengths.size) - len(batches) >= splits:  # each split needs a batch of >= 2 samples
        sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        for _ in range(splits):
            j = int(np.argmax(sizes))  # the first batch with the most samples
            half = len(batches[j]) // 2
            batches[j : j + 1] = [batches[j][:half], batches[j][half:]]
            sizes = np.concatenate([sizes[:j], [half, sizes[j] - half], sizes[j + 1 :]])
        return batches
    merges = len(batches) % world_size
    # fewer batches than ranks: merging cannot reach a multiple of the ranks
    merged, searched = (None, True) if len(batches) < world_size else \
        _merge(batches, lengths, token_budget, layout, merges, rows, row_budget)
    if merged is None:
        raise UserError(
            f"cannot give {world_size} ranks the same number of micro-batches without dropping or "
            f"repeating samples: {int(lengths.size)} samples in {len(batches)} micro-batches, too few "
            f"with 2+ samples to split, and "
            + (f"no {merges} merges of them fit together" if searched else
               f"no {merges} merges that fit found in {MERGE_STATES} tries")
            + f" in the token budget {token_budget}"
            + ("" if row_budget is None else f" and the row budget {row_budget}")
            + "; use fewer ranks, a larger budget or more data"
        )
    return merged



def _merge(batches: list, lengths: np.ndarray, token_budget: int, layout: str, merges: int,
           rows: np.ndarray | None, row_budget: int | None) -> tuple[list | None, bool]:
    """Merge micro-batches `merges` times, each time two whose union fits both budgets.

    Returns (batches or None, whether the search was exhaustive). A depth-first search whose first
    branch merges the cheapest pair that fits (almost always enough: this path only runs when nearly
    every batch holds one sample); it backtracks when that choice leaves too few pairs, and visits
    each set of unions once. Only batches that fit with some other batch can take part, since every
    part of a union that fits fits too.
    """
    def features(groups):
        members = [np.concatenate([batches[i] for i in g]) for g in groups]
        n = np.array([len(m) for m in members], dtype=np.int64)
        tok = np.array([int(lengths[m].sum()) for m in members], dtype=np.int64)
        top = np.array([int(lengths[m].max()) for m in members], dtype=np.int64)
        rws = np.array([0 if rows is None else int(rows[m].sum()) for m in members], dtype=np.int64)
        return n, tok, top, rws

    def fitting_pairs(groups):
        """Pairs (i < j) of groups whose union fits, cheapest union first (ties: lowest i, then j)."""
        n, tok, top, rws = features(groups)
        i, j = np.triu_indices(len(groups), 1)
        cost = (n[i] + n[j]) * np.maximum(top[i], top[j]) if layout == "padded" else tok[i] + tok[j]
        ok = cost <= token_budget
        if row_budget is not None:
            ok &= rws[i] + rws[j] <= row_budget
        i, j, cost = i[ok], j[ok], cost[ok]
        order = np.lexsort((j, i, cost))
        return i[order], j[order]

    i, j = fitting_pairs([(k,) for k in range(len(batches))])
    able = np.zeros(len(batches), dtype=bool)
    able[i] = able[j] = True
    seen: set = set()

    def search(groups: list, left: int) -> list | None:
        if left == 0:
            return groups
        key = frozenset(g for g in groups if len(g) > 1)
        if key in seen or len(seen) >= MERGE_STATES:
            return None
        seen.add(key)
        where = [k for k, g in enumerate(groups) if able[g[0]]]  # a union holds only able batches
        for a, b in zip(*fitting_pairs([groups[k] for k in where]), strict=True):
            p, q = where[a], where[b]
            found = search(groups[:p] + [groups[p] + groups[q]] + groups[p + 1 : q] + groups[q + 1 :], left - 1)
            if found is not None:
                return found
        return None

    found = search([(k,) for k in range(len(batches))], merges)
    if found is None:
        return None, len(seen) < MERGE_STATES
    return [np.concatenate([batches[k] for k in g]) for g in found], True

