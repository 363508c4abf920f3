"""The training-data part: token store -> checks -> held-out split -> cost per sample -> planner
-> optimizer steps -> micro-batch maker, built once from its sections (`inputs`, `batches`) and the run plan's
`DataSettings`.

Everything here is a pure function of the data and the options (no model weights), so every rank
builds the same part without talking, and `launch/speculate.py` finds a run's held-out turns with
the same functions (`store_path`, `held_out_split`, `turn_limit`).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch.distributed as dist

from dflash.data.cost import CostModel, drafter_rows
from dflash.data.generation import regeneration_limit, regeneration_temperature, stop_ids
from dflash.data.planner import DEFAULT_MIX, BatchPlanner, PlannerConfig, check_lengths
from dflash.data.sources import is_token_store, open_source
from dflash.data.supervision import min_supervised, trainable
from dflash.data.synthetic import SyntheticStore, is_synthetic, open_store, synthetic_store
from dflash.data.token_store import TokenStore
from dflash.distributed.ranks import on_rank0
from dflash.distributed.run_folder import RunPaths
from dflash.errors import UserError
from dflash.training.config.sections import Batches, Inputs, Run
from dflash.training.steps import MicroBatchMaker, step_ranges


def held_out_split(num_samples: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic held-out split: (train indices, eval indices), both sorted."""
    perm = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED])).permutation(num_samples)
    n_eval = int(round(num_samples * eval_fraction)) if eval_fraction > 0 else 0
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def token_subset(indices: np.ndarray, lengths: np.ndarray, tokens: int, seed: int) -> np.ndarray:
    """A random subset of `indices` (into `lengths`) holding about `tokens` tokens: samples in a
    seeded random order until their lengths reach it, sorted. It depends on neither the batch order
    nor the layout, so every mode of a comparison trains on the same samples."""
    perm = np.random.default_rng(np.random.SeedSequence([seed, 0x5AB5E7])).permutation(indices.size)
    reached = np.cumsum(lengths[indices[perm]])
    return np.sort(indices[perm[:min(int(np.searchsorted(reached, tokens)) + 1, indices.size)]])


def store_path(data: Path, output_dir: Path) -> Path:
    """Where a run's token store is: `--data` itself when it is a store folder (its dflash_store.json),
    else the store the run prepared from the conversations (any format), `<output_dir>/data`."""
    return data if is_token_store(data) else RunPaths(output_dir).store


def source_file(store: TokenStore, data: Path) -> Path:
    """The conversations the token store was prepared from (the data themselves when not a store)."""
    return Path(store.meta.get("summary", {}).get("input", "")) if is_token_store(data) else data


def _regenerated_jsonl(store: TokenStore, data: Path) -> Path | None:
    """The source when it is a JSONL file: what regenerate writes, with the `meta` read below."""
    source = source_file(store, data)
    return source if source.is_file() and store.meta.get("input_format", "jsonl") == "jsonl" else None


def turn_limit(store: TokenStore, data: Path) -> int | None:
    """The per-turn token limit the data were regenerated with (their `meta`), if they say: eval
    walks and decoding stop there, as the regeneration did."""
    source = _regenerated_jsonl(store, data)
    return regeneration_limit(source) if source else None


def data_temperature(store: TokenStore, data: Path) -> float | None:
    """The temperature the data were regenerated at (their `meta`; 0: greedy), if they say: the eval
    walk at that temperature is exact in expectation."""
    source = _regenerated_jsonl(store, data)
    return regeneration_temperature(source) if source else None


def check_data(inputs: Inputs, run: Run) -> None:
    """--data before anything loads: synthetic, a token store, or conversations whose format and
    conversation column are read now (one line naming the file, the formats or the columns found); on
    --resume, conversations changed since the run's store was prepared from them are refused."""
    if is_synthetic(inputs.data):
        return
    data = Path(inputs.data)
    if not data.exists():
        raise UserError(f"--data {inputs.data}: no such file or folder")
    if is_token_store(data):
        if inputs.messages_field:
            raise UserError(f"--messages-field {inputs.messages_field}: --data {inputs.data} is a token store, "
                            "prepared already; the column applies to conversations")
        return
    source = open_source(data, messages_field=inputs.messages_field or None, flag="--data")
    store = store_path(data, Path(run.output_dir))
    if run.resume and not run.force_resume and store.exists():
        from dflash.data.prepare import input_differences, refuse_changed_store

        # the input's content is known without the target's tokenizer: a changed shard is refused now
        refuse_changed_store(store, input_differences(store, source))


def positions_warning(lengths: np.ndarray, positions: int | None, name) -> str | None:
    """What to say of samples longer than the target's positions (its `max_position_embeddings`):
    the target computes their features at positions it was not made for. None when all fit."""
    if not positions or not lengths.size or int(lengths.max()) <= positions:
        return None
    over = np.flatnonzero(lengths > positions)
    longest = int(np.argmax(lengths))
    return (f"{len(over):,} of {lengths.size:,} samples are longer than the target's {positions:,} positions "
            f"(max_position_embeddings), the longest {name(longest)} with {int(lengths[longest]):,} tokens: the "
            f"target was not made for the positions past {positions:,}; cut them with --max-length {positions} "
            "(when --data is a store: prepare it again with prepare_data.py --max-length)")


def chat_data(inputs: Inputs) -> str | None:
    """The conversations the target's chat template will render (None: a store or synthetic data)."""
    return None if is_synthetic(inputs.data) or is_token_store(Path(inputs.data)) else inputs.data


def prepare_token_store(inputs: Inputs, run: Run, tokenizer, say) -> Path | SyntheticStore:
    """A token store folder as is, or conversations (JSONL, JSON, parquet, Arrow, a folder of parquet
    shards or a save_to_disk folder) prepared (by rank 0) into the run folder, reused
    while its fingerprints match (a resume refuses one of other data); `random[:SAMPLES]`: synthetic
    samples in memory (`dflash.data.synthetic`), the same on every rank."""
    if is_synthetic(inputs.data):
        return synthetic_store(inputs.data, tokenizer, seed=run.seed, max_length=inputs.max_length)
    data = Path(inputs.data)
    path = store_path(data, Path(run.output_dir))
    if is_token_store(data):
        return path
    from dflash.data.prepare import ensure_store

    on_rank0(lambda: ensure_store(data, tokenizer, path, max_length=inputs.max_length,
                                  refuse_changes=run.resume and not run.force_resume,
                                  progress=run.progress, say=say,
                                  messages_field=inputs.messages_field or None),
             "preparing the data")
    return path


def _sample_name(store, path):
    """How a refusal names sample i: its line in the source file, when the store knows it."""
    if isinstance(store, SyntheticStore):
        return lambda i: f"--data {path}: sample {i}"
    source = store.meta.get("summary", {}).get("input", "the source file")
    unit = store.meta.get("summary", {}).get("unit", "line")
    return lambda i: f"--data {path}: sample {i} ({unit} {store.dataset[i]['source_line']} of {source})"


class TrainingData:
    """What the run trains and evaluates on, and in which order.

    Attributes: `store` (the token store at `store_path`), `train_idx` / `eval_idx` (store
    indices), `lengths` (of the training samples), `flop_model` (the FLOP cost of a sample;
    with what the drafter kind adds per row),
    `planner` (epoch plans and the run's position), `balance` (dealt by cost: --balance on
    several ranks), `steps[epoch]` (micro-step ranges of each
    optimizer step), `total_steps`, `maker` (collates a micro-batch and draws its anchors),
    `turn_limit` and `stop_ids` (where held-out turns end, as decoding ends them), `data_temperature`
    (what the data were regenerated at, when their `meta` says).

    Built from the `inputs` and `batches` sections and the run plan's `DataSettings` (`settings`).
    """

    def __init__(self, inputs: Inputs, batches: Batches, settings, path: Path | SyntheticStore, *, tokenizer,
                 target_spec, target_layer_ids, vocab_rows: int, mask_token_id: int, world_size: int):
        s, b = settings, batches
        self.store_path = path
        self.store = store = open_store(path)
        store.check_tokenizer(tokenizer, f"--target {inputs.target}")
        if store.vocab_size is not None and store.vocab_size > vocab_rows:
            raise UserError(f"--data {path}: tokenized with a vocabulary of {store.vocab_size} tokens, but the "
                            f"target's embedding has {vocab_rows} rows; prepare the data with the target's tokenizer")
        check_lengths(store.lengths, b.token_budget, name=_sample_name(store, path))
        beyond = positions_warning(store.lengths, target_spec.positions, _sample_name(store, path))
        if beyond and (not dist.is_initialized() or dist.get_rank() == 0):
            warnings.warn(beyond, stacklevel=2)
        self.usable = int(trainable(store.supervised, s.block_size).sum())
        if self.usable == 0:
            raise UserError(f"--block-size {s.block_size}: a sample needs at least "
                            f"{min_supervised(s.block_size)} "
                            f"supervised tokens to be trained on, and none of the {len(store):,} samples of {path} has "
                            f"(most: {int(store.supervised.max())}); use a smaller block size")
        self.train_idx, self.eval_idx = held_out_split(len(store), inputs.eval_fraction, s.seed)
        if inputs.subset_tokens:
            self.train_idx = token_subset(self.train_idx, store.lengths, inputs.subset_tokens, s.seed)
        self.turn_limit = turn_limit(store, Path(inputs.data))
        self.data_temperature = data_temperature(store, Path(inputs.data))
        self.stop_ids = stop_ids(tokenizer, target_spec.generation_eos())
        self.lengths = store.lengths[self.train_idx]
        # what each sample costs: drafter rows from its anchor candidates, FLOPs from the sizes
        from dflash.sizing.flops import flop_cost_model

        self.flop_model = flop_cost_model(target_spec.config, num_target_layers=max(target_layer_ids) + 1,
                                          draft_layers=s.draft_layers, num_features=len(target_layer_ids),
                                          block_size=s.block_size, extra_row_flops=s.extra_row_flops)
        rows = costs = None
        # dealing by cost is between ranks: one rank plans as without it (the same plan, the same checkpoints)
        self.balance = balance = b.balance and world_size > 1
        if balance or b.row_budget:
            candidates = store.candidates()
            rows = drafter_rows(candidates[self.train_idx], store.supervised[self.train_idx], s.block_size,
                                s.num_anchors)
        if balance:
            model = CostModel.load(b.cost_model) if b.cost_model else self.flop_model
            costs = model.sample_costs(self.lengths, rows)
        mix = max(1, round(b.step_tokens / b.token_budget)) if balance else DEFAULT_MIX
        self.planner = BatchPlanner(self.lengths, PlannerConfig(
            token_budget=b.token_budget, order=b.order, layout=b.layout, boundaries=b.boundaries,
            seed=s.seed, world_size=world_size, window=b.packing_window, row_budget=b.row_budget or None,
            balance=balance, mix=mix, buckets=b.buckets), rows=rows, costs=costs)
        self.steps = [step_ranges(self.planner.plan(e), self.lengths, b.step_tokens) for e in range(s.epochs)]
        self.total_steps = sum(len(r) for r in self.steps)
        if s.max_steps:
            self.total_steps = min(self.total_steps, s.max_steps)
        self.maker = MicroBatchMaker(path, b.layout, pad_id=tokenizer.pad_token_id or 0,
                                     mask_token_id=mask_token_id, block_size=s.block_size,
                                     num_anchors=s.num_anchors, gamma=s.gamma, seed=s.seed,
                                     window=self.flop_model.window)

    def batches(self, epoch: int, rank: int) -> list[np.ndarray]:
        """This rank's micro-batches of an epoch, as store indices."""
        return [self.train_idx[b] for b in self.planner.plan(epoch)[rank]]

    def step_tokens(self) -> list[int]:
        """Real tokens (all ranks) of each optimizer step the run will take, from the plan alone."""
        tokens = []
        for epoch, ranges in enumerate(self.steps):
            plan = self.planner.plan(epoch)
            for first, end in ranges:
                tokens.append(int(sum(self.lengths[np.concatenate(p[first:end])].sum() for p in plan)))
        return tokens[:self.total_steps]
