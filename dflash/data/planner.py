"""The batch planner: which samples form each micro-batch, on which rank, in which epoch.

Orders (what the stream of samples looks like):
  sorted    the seed's original: sorted by length; compositions are fixed across epochs and
            only the order of the batches is reshuffled every epoch.
  shuffle   a fresh random permutation of all samples every epoch.
  bucketed  samples shuffled inside length buckets; compositions redrawn every epoch and the
            batches of all buckets interleaved at random.
Layouts (what fits in one micro-batch of `token_budget` tokens):
  padded    count x longest <= budget (greedy, in stream order).
  packed    sum of lengths <= budget: best fit among a small window of open bins fed in stream
            order, so the random order survives (see docs/ARCHITECTURE.md for how the window
            changes which samples meet).

Memory caps: besides the token budget, an optional drafter row budget caps the block rows of
every micro-batch (`rows` per sample: block_size x its anchors; the drafter's activations grow
with rows, the frozen target's with tokens).

Dealing to ranks: round robin, or with `balance` by cost (`costs` per sample, from
`dflash.data.cost`; the dealer: `dflash.data.dealing`): ZeRO-3 waits for the slowest rank at every
forward, so the ranks of one micro-batch index get micro-batches of similar cost, and runs of `mix`
indices (about a step) keep a mean length near the epoch's, so that a step still mixes lengths (see
docs/ARCHITECTURE.md).

Every sample is used exactly once per epoch, every rank gets the same number of
micro-batches (`dflash.data.rank_counts`), and the plan is a pure function of (lengths, rows, costs, settings, seed,
epoch, world_size).
"""
from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import numpy as np

from dflash.data import packing
from dflash.data.buckets import optimal_buckets
from dflash.data.dealing import deal
from dflash.data.rank_counts import equal_counts
from dflash.errors import UserError

ORDERS = ("sorted", "shuffle", "bucketed")
LAYOUTS = ("padded", "packed")
DEFAULT_WINDOW = 8  # open bins of the packer; 8 already fills > 99.9% on the seed lengths
DEFAULT_BUCKETS = 6
DEFAULT_MIX = 4  # micro-batch indices per run of the dealer (set it to the micro-batches per step)


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))


def check_lengths(lengths, token_budget: int, name=None) -> np.ndarray:
    """The lengths as int64, each from 1 to the token budget; `name(i)` names sample i in the
    message (default: "sample i"), e.g. with its source line."""
    name = name or (lambda i: f"sample {i}")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise UserError(f"lengths must be a 1-D integer array, got {lengths.dtype} of shape {lengths.shape}")
    if lengths.size == 0:
        raise UserError("no samples to plan")
    lengths = lengths.astype(np.int64)
    if token_budget < 1:
        raise UserError(f"token budget must be positive, got {token_budget}")
    bad = np.flatnonzero(lengths < 1)
    if bad.size:
        raise UserError(f"{name(int(bad[0]))} has length {int(lengths[bad[0]])}; every sample needs >= 1 token")
    over = np.flatnonzero(lengths > token_budget)
    if over.size:
        i = int(over[0])
        raise UserError(
            f"{name(i)} has {int(lengths[i])} tokens, more than --token-budget {token_budget} "
            f"({over.size} sample(s) do); raise --token-budget, or cap lengths when preparing "
            "the data (--max-length N; prepare_data.py also takes --overlong truncate|drop)"
        )
    return lengths


def bucket_edges(lengths: np.ndarray, config: PlannerConfig) -> np.ndarray:
    """Full boundaries `[0, b1, ..., longest]` from the config's boundaries (inner or full) or, when
    it has none, the optimal `config.buckets` buckets for its token budget."""
    if config.boundaries is None:
        return optimal_buckets(lengths, config.buckets, config.token_budget)
    inner = np.asarray(config.boundaries, dtype=np.int64)
    longest = int(lengths.max())
    inner = np.unique(inner[(inner > 0) & (inner < longest)])
    return np.concatenate([[0], inner, [longest]]).astype(np.int64)


def check_rows(rows, lengths: np.ndarray, row_budget: int | None) -> np.ndarray | None:
    """Drafter rows per sample (None: not known); each must fit the row budget."""
    if rows is None:
        if row_budget is not None:
            raise UserError("a drafter row budget needs the drafter rows of every sample")
        return None
    rows = np.asarray(rows)
    if rows.shape != lengths.shape or not np.issubdtype(rows.dtype, np.integer):
        raise UserError(f"drafter rows must be {lengths.size} integers (one per sample), got {rows.dtype} "
                        f"of shape {rows.shape}")
    rows = rows.astype(np.int64)
    if row_budget is not None:
        if row_budget < 1:
            raise UserError(f"drafter row budget must be positive, got {row_budget}")
        over = np.flatnonzero(rows > row_budget)
        if over.size:
            i = int(over[0])
            raise UserError(f"sample {i} has {int(rows[i])} drafter rows, more than the row budget {row_budget} "
                            f"({over.size} sample(s) do); raise the row budget to at least block_size x anchors "
                            "per sample")
    return rows


def check_costs(costs, lengths: np.ndarray) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    if costs.shape != lengths.shape:
        raise UserError(f"costs must be one per sample ({lengths.size}), got shape {costs.shape}")
    if not np.isfinite(costs).all() or (costs < 0).any():
        i = int(np.flatnonzero(~np.isfinite(costs) | (costs < 0))[0])
        raise UserError(f"sample {i} has cost {costs[i]}; costs must be finite and >= 0")
    return costs


def _group(lengths: np.ndarray, stream: np.ndarray, token_budget: int, layout: str, window: int,
           rows: np.ndarray | None, row_budget: int | None):
    """Cut a stream of sample indices into micro-batches."""
    if stream.size == 0:
        return []
    caps = {} if rows is None else {"rows": rows[stream], "row_budget": row_budget}
    if layout == "padded":
        offsets = packing.pad_greedy(lengths[stream], token_budget, **caps)
        return np.split(stream, offsets[1:-1])
    items, offsets = packing.pack_best_fit(lengths[stream], token_budget, window, **caps)
    return np.split(stream[items], offsets[1:-1])


@dataclass(frozen=True)
class PlannerConfig:
    """How one epoch is planned (the data, `lengths`, `rows` and `costs`, are arguments of their own).

    token_budget: tokens per micro-batch (padded: count x longest; packed: sum of lengths).
    order: "sorted", "shuffle" or "bucketed".  layout: "padded" or "packed".
    boundaries: bucket boundaries for "bucketed" (inner `[b1, ...]` or full `[0, ..., max]`);
        None: the optimal `buckets` buckets of `optimal_buckets`.
    seed: the plan is a pure function of the seed, the epoch and the rest.
    world_size: number of ranks; rank r gets global micro-batches r, r + W, r + 2W, ...
    window: open bins of the packed layout's best-fit packer.
    row_budget: at most this many drafter rows per micro-batch (needs `rows`); None: no cap.
    balance: deal micro-batches of similar cost to the ranks of each index (`dflash.data.dealing.deal`); False:
        round robin in plan order.
    mix: indices per run when balancing (runs keep the epoch's mean length); set it to the
        micro-batches per rank and step, so that steps keep mixing lengths.
    """

    token_budget: int
    order: str = "shuffle"
    layout: str = "packed"
    boundaries: tuple | None = None
    seed: int = 0
    world_size: int = 1
    window: int = DEFAULT_WINDOW
    row_budget: int | None = None
    balance: bool = False
    mix: int = DEFAULT_MIX
    buckets: int = DEFAULT_BUCKETS

    def check(self) -> None:
        if self.order not in ORDERS:
            raise UserError(f"order must be one of {', '.join(ORDERS)}; got {self.order!r}")
        if self.layout not in LAYOUTS:
            raise UserError(f"layout must be one of {', '.join(LAYOUTS)}; got {self.layout!r}")
        if self.world_size < 1:
            raise UserError(f"world size must be >= 1, got {self.world_size}")
        if self.mix < 1:
            raise UserError(f"mix (micro-batch indices per run of the dealer) must be >= 1, got {self.mix}")


def plan_epoch(lengths, config: PlannerConfig, *, epoch: int = 0, rows=None, costs=None) -> list:
    """All micro-batches of one epoch in global order: rank r runs global micro-batches r, r + W, ..."""
    c = config
    c.check()
    lengths = check_lengths(lengths, c.token_budget)
    rows = check_rows(rows, lengths, c.row_budget)
    costs = lengths.astype(np.float64) if costs is None else check_costs(costs, lengths)
    rng = _rng(c.seed, epoch)
    caps = (rows, c.row_budget)
    if c.order == "sorted":
        stream = np.argsort(lengths, kind="stable")
        batches = _group(lengths, stream, c.token_budget, c.layout, c.window, *caps)
        batches = [batches[i] for i in rng.permutation(len(batches))]
    elif c.order == "shuffle":
        batches = _group(lengths, rng.permutation(lengths.size), c.token_budget, c.layout, c.window, *caps)
    else:
        edges = bucket_edges(lengths, c)
        bucket = np.searchsorted(edges[1:-1], lengths, side="left")
        batches = []
        for b in range(len(edges) - 1):
            members = np.flatnonzero(bucket == b)
            batches += _group(lengths, members[rng.permutation(members.size)], c.token_budget, c.layout, c.window,
                              *caps)
        batches = [batches[i] for i in rng.permutation(len(batches))]
    batches = equal_counts(batches, lengths, c.token_budget, c.layout, c.world_size, *caps)
    if not c.balance:
        return batches
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    flat, starts = np.concatenate(batches), np.concatenate([[0], np.cumsum(sizes)[:-1]])
    batch_costs = np.add.reduceat(costs[flat], starts)
    batch_tokens = np.add.reduceat(lengths[flat], starts).astype(np.float64)
    return deal(batches, batch_costs, sizes, batch_tokens, c.world_size, c.mix, rng)


def plan_batches(lengths, config: PlannerConfig, *, epoch: int = 0, rows=None, costs=None) -> list:
    """Plan one epoch: for each rank, the list of its micro-batches (int64 arrays of sample indices).

    Args:
        lengths: `(N,)` integer token counts of the samples.
        config: the planner's settings (`PlannerConfig`).
        epoch: the plan is a pure function of the epoch, the config's seed and the rest.
        rows: `(N,)` drafter block rows per sample (`dflash.data.cost.drafter_rows`), or None.
        costs: `(N,)` cost per sample (`CostModel.sample_costs`) for `config.balance`; None: tokens.

    Returns:
        `plan[rank][i]` is the i-th micro-batch of `rank`; all ranks have the same count.

    Example:
        >>> plan = plan_batches(np.array([5, 3, 8, 2]), PlannerConfig(10, "shuffle", "packed", seed=1))
        >>> sorted(np.concatenate(plan[0]).tolist())
        [0, 1, 2, 3]
    """
    batches = plan_epoch(lengths, config, epoch=epoch, rows=rows, costs=costs)
    return [batches[r::config.world_size] for r in range(config.world_size)]


_UNBALANCED_FINGERPRINT = {"row_budget": None, "balance": False, "mix": DEFAULT_MIX, "rows_crc32": None,
                           "costs_crc32": None}


class BatchPlanner:
    """Plans epoch after epoch and remembers where the run is: `(epoch, position)`, the number
    of micro-batches every rank has consumed in the current epoch. Checkpoints save
    `state_dict()`; a resume restores it and continues with exactly the next micro-batch.
    `rows` (drafter rows per sample) and `costs` (cost per sample) are data like the lengths:
    the fingerprint holds their checksums.
    """

    def __init__(self, lengths, config: PlannerConfig, *, rows=None, costs=None):
        self.lengths = check_lengths(lengths, config.token_budget)
        self.rows = check_rows(rows, self.lengths, config.row_budget)
        self.costs = None if costs is None else check_costs(costs, self.lengths)
        self.config = config
        if config.order == "bucketed":
            edges = bucket_edges(self.lengths, config)
            self.config = config = PlannerConfig(**{**asdict(config), "boundaries": tuple(int(e) for e in edges)})
        self.epoch, self.position = 0, 0
        self._cached = None  # (epoch, plan)

    def plan(self, epoch: int) -> list:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, plan_batches(self.lengths, self.config, epoch=epoch, rows=self.rows,
                                                costs=self.costs))
        return self._cached[1]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.plan(epoch)[0])

    def batch(self, rank: int, epoch: int, position: int) -> np.ndarray:
        return self.plan(epoch)[rank][position]

    def advance(self, micro_batches: int = 1) -> None:
        """Mark micro-batches as consumed, rolling over into the next epoch."""
        self.position += micro_batches
        while self.position >= self.steps_in_epoch(self.epoch):
            self.position -= self.steps_in_epoch(self.epoch)
            self.epoch += 1

    def fingerprint(self) -> dict:
        settings = asdict(self.config)
        del settings["buckets"]  # resolved into the boundaries
        return {
            **{k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items()},
            "num_samples": int(self.lengths.size),
            "total_tokens": int(self.lengths.sum()),
            "lengths_crc32": zlib.crc32(self.lengths.tobytes()),
            "rows_crc32": None if self.rows is None else zlib.crc32(self.rows.tobytes()),
            "costs_crc32": None if self.costs is None else zlib.crc32(self.costs.tobytes()),
        }

    def to_step_boundary(self, steps) -> int | None:
        """Move to the first optimizer step at or after the position (the next epoch when none is
        left); `steps`: per epoch, its steps as (first, end) micro-step ranges. Returns the position
        it left, None when it stood on a step's first micro-step (always, but after a forced resume)."""
        epoch, position = self.epoch, self.position
        boundary = next((first for first, _ in steps[epoch] if first >= position), None) \
            if epoch < len(steps) else position
        if boundary == position:
            return None
        if boundary is None:
            self.epoch, self.position = epoch + 1, 0
        else:
            self.position = boundary
        return position

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict, *, force: bool = False) -> list[str]:
        """Restore (epoch, position). A checkpoint planned with other settings or data is refused
        unless `force`; returns the list of differences (empty when identical)."""
        # checkpoints from before cost balancing lack its settings: they planned with the defaults
        saved = {**_UNBALANCED_FINGERPRINT, **state["fingerprint"]}
        now = self.fingerprint()
        diffs = [f"{k}: checkpoint {saved.get(k)!r} -> now {now.get(k)!r}"
                 for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if diffs and not force:
            raise UserError(
                "the checkpoint was planned with different data or planner settings:\n  "
                + "\n  ".join(diffs)
                + "\nresume with the same settings, or force it (--force-resume) to replan from the saved position"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if self.position >= self.steps_in_epoch(self.epoch):  # possible only when forced
            self.epoch, self.position = self.epoch + 1, 0
        return diffs
