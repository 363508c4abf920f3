"""The evaluator part: the decoding walk on the held-out turns (every rank, summed), greedy `tau` and
`tau@T`, the expected acceptance of speculative sampling at each temperature of --eval-temperatures,
and at the end of a run greedy speculative decoding of the first held-out turns with the exported
drafter."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.data.batch import PackedBatch
from dflash.data.planner import PlannerConfig, plan_batches
from dflash.training.config import TrainConfig
from dflash.training.data import TrainingData
from dflash.training.models import Models


class Evaluator:
    def __init__(self, cfg: TrainConfig, data: TrainingData, models: Models, device, dtype):
        self.cfg, self.data, self.models, self.device, self.dtype = cfg, data, models, device, dtype
        self._chunks = None  # held-out micro-batches and the drafter forwards each takes, once planned
        self._noted = False

    def _batch(self, indices) -> PackedBatch:
        """Held-out samples packed, every turn cut where decoding stops: its first stop token, or the
        token limit the data were regenerated with."""
        from dflash.data.collate import collate_packed
        from dflash.models.acceptance import limited

        d = self.data
        return limited(collate_packed(d.maker.store, d.eval_idx[indices]), d.turn_limit, d.stop_ids)

    def _plan(self) -> tuple[list, list[int]]:
        """Held-out micro-batches (sorted, packed) and how many drafter forwards each takes (cached)."""
        from dflash.models.acceptance import every_anchor

        if self._chunks is None:
            lengths = self.data.maker.store.lengths[self.data.eval_idx]
            config = PlannerConfig(self.cfg.token_budget, "sorted", "packed", seed=self.cfg.seed)
            batches = plan_batches(lengths, config)[0]
            forwards = [len(every_anchor(self._batch(b), self.cfg.block_size)) for b in batches]
            self._chunks = (batches, forwards)
        return self._chunks

    @torch.no_grad()
    def walk(self) -> dict | None:
        """Walk tau on the held-out split: a block at every position of every assistant turn (short
        ones too), walked as greedy speculative decoding does (`dflash.models.acceptance`), and
        `tau@T` at each temperature of --eval-temperatures; beside them anchor_tau (the mean over
        those blocks), per-slot accuracy and the loss. Collective."""
        from dflash.models.acceptance import WalkStats, every_anchor, score_and_walk, target_inputs

        if self.data.eval_idx.size == 0:
            return None
        B, rank, world_size = self.cfg.block_size, dist.get_rank(), dist.get_world_size()
        temperatures = self.cfg.eval_temperatures
        target, engine = self.models.target.model, self.models.engine
        batches, chunks = self._plan()
        # Round-robin over ranks. Every rank runs the same number of forwards (ZeRO-3 gathers
        # parameters collectively), so a rank with fewer repeats one and discards it.
        forwards = max(sum(chunks[r::world_size]) for r in range(world_size))
        stats, done = WalkStats(B, temperatures), 0

        def forward(batch, features, anchors, **kwargs):
            return engine(batch, features, anchors=anchors, **kwargs)

        for k in range(rank, len(batches), world_size):
            batch = self._batch(batches[k]).to(self.device)
            chunk = every_anchor(batch, B)
            features, logprobs = target_inputs(target, batch, temperatures)
            stats.add(score_and_walk(forward, batch, features, chunk, block_size=B, temperatures=temperatures,
                                     target_logprobs=logprobs))
            done += len(chunk)
        if done < forwards:
            batch = self._batch(batches[next(k for k, c in enumerate(chunks) if c)]).to(self.device)
            features, anchors = target.features(batch), every_anchor(batch, B)[0]
            for _ in range(forwards - done):
                forward(batch, features, anchors)
        total = stats.to_tensor(self.device)
        dist.all_reduce(total)
        return WalkStats.from_tensor(total, B, temperatures).metrics()

    def temperature_note(self) -> str | None:
        """Once: what tau@T means on these held-out turns when they were not sampled at T."""
        t = self.data.data_temperature
        others = [x for x in self.cfg.eval_temperatures if x > 0 and x != t]
        if self._noted or not others or self.data.eval_idx.size == 0:
            return None
        self._noted = True
        origin = ("of unknown origin (no meta.temperature)" if t is None else
                  "regenerated greedily" if t == 0 else f"sampled at temperature {t:g}")
        return (f"note: the held-out turns are {origin}; {', '.join(f'tau@{x:g}' for x in others)} follow them, the "
                "acceptance decoding would have on them, exact for decoding at T only on turns sampled at T "
                "(launch/regenerate.py --temperature T; docs/ARCHITECTURE.md)")

    def speculate_heldout(self, drafter_dir: Path, step: int, output: Path, turns: int) -> dict:
        """Greedy speculative decoding of the first `turns` held-out turns with the exported drafter
        (call on one rank): the acceptance length decoding reaches, to set beside the eval walk tau;
        written to `output` as JSON."""
        from dflash.models import DFlashDrafter
        from dflash.models.speculate import DEFAULT_MAX_NEW_TOKENS, prompts_from_samples, speculate

        d, target = self.data, self.models.target
        prompts = prompts_from_samples((d.maker.store[int(i)] for i in d.eval_idx), turns)
        drafter = DFlashDrafter.from_pretrained(drafter_dir, target.model.shared_weights())
        drafter.to(self.device, self.dtype).eval()
        limit = d.turn_limit or DEFAULT_MAX_NEW_TOKENS
        report = speculate(target.hf, drafter, prompts, max_new_tokens=limit, stop_ids=d.stop_ids,
                           reference=False, progress=self.cfg.progress).summary()
        result = {"step": step, "max_new_tokens": limit, **report}
        output.write_text(json.dumps(result, indent=2) + "\n")
        return result
