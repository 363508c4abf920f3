"""The evaluator part: the decoding walk on the held-out split (every rank, summed) and, at the end
of a run, greedy speculative decoding of the first held-out turns with the exported drafter.

The walk gives greedy `tau` on the data's held-out turns (on greedy regenerated data, decoding's
figure exactly) and `tau@T` at each temperature T > 0 of --eval-temperatures, the expected
acceptance of speculative sampling at T, which is exact in expectation only along turns the
target sampled at T. So unless the data say they were sampled at T (`meta.temperature`), `tau@T`
walks the prompts of the first --eval-sample-turns held-out turns continued by the target alone at
T (`sampled_turns`: sampled once per run, each turn from its own seed, kept in the run folder's
eval_turns.json), with its standard error over those turns (`tau@T_stderr`).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash.data.batch import PackedBatch
from dflash.distributed.run_folder import RunPaths
from dflash.training.config.sections import Eval
from dflash.training.data import TrainingData
from dflash.training.models import Models
from dflash.training.plan import EvalSettings


def turn_seed(seed: int, temperature: float, turn: int) -> int:
    """The seed of held-out turn `turn` sampled at `temperature` in a run seeded with `seed`: the same
    whichever rank samples it, and however many ranks there are."""
    return int(np.random.SeedSequence([seed, 0x7E3B, round(temperature * 1_000_000), turn]).generate_state(1)[0])


class Evaluator:
    def __init__(self, options: Eval, settings: EvalSettings, data: TrainingData, models: Models, device, dtype,
                 say: Callable[[str], None] = lambda text: None):
        """`options`: the `eval` section; `settings`: the run plan's `EvalSettings`."""
        self.options, self.settings = options, settings
        self.data, self.models, self.device, self.dtype = data, models, device, dtype
        self.say = say  # rank 0's messages
        self._chunks = None  # held-out micro-batches and the drafter forwards each takes, once planned
        self._turns: dict[float, list] = {}  # this rank's share of the turns sampled at each temperature
        self._sampled_count = 0  # turns sampled at each temperature, all ranks
        self._noted = False
        self._score = None  # the drafter and the loss on the blocks at given anchors

    def _batch(self, indices) -> PackedBatch:
        """Held-out samples packed, every turn cut where decoding stops: its first stop token, or the
        token limit the data were regenerated with."""
        from dflash.data.collate import collate_packed
        from dflash.decoding.acceptance import limited

        d = self.data
        return limited(collate_packed(d.maker.store, d.eval_idx[indices]), d.turn_limit, d.stop_ids)

    def _plan(self) -> tuple[list, list[int]]:
        """Held-out micro-batches (sorted, packed) and how many drafter forwards each takes (cached)."""
        from dflash.decoding.acceptance import every_anchor, heldout_batches

        if self._chunks is None:
            lengths = self.data.maker.store.lengths[self.data.eval_idx]
            batches = heldout_batches(lengths, self.settings.token_budget, sort=True, seed=self.settings.seed)
            forwards = [len(every_anchor(self._batch(b), self.settings.block_size)) for b in batches]
            self._chunks = (batches, forwards)
        return self._chunks

    def sampled_temperatures(self) -> tuple[float, ...]:
        """The temperatures whose tau@T walks turns sampled by the target (`sampled_turns`): every T > 0
        of --eval-temperatures the held-out data were not sampled at (unknown counts as not), unless
        --eval-sample-turns is 0 or the target is partitioned (sampling needs it whole on each rank)."""
        if not self.options.eval_sample_turns or self.data.eval_idx.size == 0 or self.settings.partitioned:
            return ()
        return tuple(t for t in self.options.eval_temperatures if t > 0 and t != self.data.data_temperature)

    @torch.no_grad()
    def walk(self) -> dict | None:
        """Walk tau on the held-out split: a block at every position of every assistant turn (short
        ones too), walked as greedy speculative decoding does (`dflash.decoding.acceptance`), beside it
        anchor_tau (the mean over those blocks), per-slot accuracy and the loss; and `tau@T` with
        `tau@T_stderr` at each T > 0 of --eval-temperatures, on the turns sampled at T
        (`sampled_temperatures`) or on the data's. Collective."""
        if self.data.eval_idx.size == 0:
            return None
        sampled = self.sampled_temperatures()
        record = self._walk_data(tuple(t for t in self.options.eval_temperatures if t not in sampled))
        if sampled:
            record.update(self._walk_sampled(sampled))
        return record

    def _forward(self, batch, features, anchors, **kwargs):
        if self._score is None:
            from dflash.objective.blocks import block_scorer

            m = self.data.maker
            self._score = block_scorer(self.models.engine, self.models.eval_loss, self.models.drafter.lm_head,
                                       mask_token_id=m.mask_token_id, slot_weights=m.weights)
        return self._score(batch, features, anchors, **kwargs)

    def _stand_in(self) -> tuple:
        """A held-out batch, its taps and first anchors, for the discarded forwards that keep ranks in
        step; its target forward is collective when the target is partitioned, so every rank makes it
        at the same point."""
        from dflash.decoding.acceptance import every_anchor

        batches, chunks = self._plan()
        batch = self._batch(batches[next((k for k, c in enumerate(chunks) if c), 0)]).to(self.device)
        return batch, self.models.target.model.features(batch), every_anchor(batch, self.settings.block_size)[0]

    def _repeat_forwards(self, count: int, stand_in) -> None:
        """`count` drafter forwards on the stand-in, discarded: every rank runs as many drafter
        forwards as the busiest (ZeRO-3 gathers parameters collectively)."""
        for _ in range(count):
            self._forward(*stand_in)

    def _walk_data(self, temperatures: tuple[float, ...]) -> dict:
        """The walk on the data's held-out turns, round robin over ranks: greedy tau and tau@T at
        `temperatures`."""
        from dflash.decoding.acceptance import every_anchor, score_and_walk
        from dflash.decoding.expected_walk import target_inputs
        from dflash.decoding.walk_stats import WalkStats

        B, rank, world_size = self.settings.block_size, dist.get_rank(), dist.get_world_size()
        target = self.models.target.model
        batches, chunks = self._plan()
        # Round robin over ranks, in rounds that every rank runs alike: one target forward and as
        # many drafter forwards as the busiest rank of the round (a partitioned target and ZeRO-3
        # gather parameters collectively, in the same order everywhere); a rank past the last batch
        # runs the target on a stand-in batch, and the extra forwards are discarded.
        loss = self.models.eval_loss  # its terms' named sums ride in the walk's vector, and become its figures
        stats = WalkStats(B, temperatures, metric_names=loss.metric_names)
        padded = chunks + [0] * (-len(chunks) % world_size)
        rounds = [padded[i:i + world_size] for i in range(0, len(padded), world_size)]
        uneven = len(padded) > len(chunks) or any(c < max(r) for r in rounds for c in r)
        stand_in = self._stand_in() if uneven else None  # on every rank alike
        for i, forwards in enumerate(rounds):
            k = i * world_size + rank
            if k < len(batches):
                batch = self._batch(batches[k]).to(self.device)
                features, logprobs = target_inputs(target, batch, temperatures)
                stats.add(score_and_walk(self._forward, batch, features, every_anchor(batch, B), block_size=B,
                                         temperatures=temperatures, target_logprobs=logprobs))
            else:
                target_inputs(target, stand_in[0], temperatures)
            self._repeat_forwards(max(forwards) - forwards[rank], stand_in)
        total = stats.to_tensor(self.device)
        dist.all_reduce(total)
        return WalkStats.from_tensor(total, B, temperatures, loss.metric_names, loss.figures).metrics()

    def _walk_sampled(self, temperatures: tuple[float, ...]) -> dict:
        """tau@T and tau@T_stderr along the turns sampled at each of `temperatures` (this rank's share,
        summed over ranks)."""
        from dflash.decoding.acceptance import walk_samples
        from dflash.decoding.walk_stats import WalkStats, stderr_key, tau_key

        B = self.settings.block_size
        turns = {t: self.sampled_turns(t) for t in temperatures}
        forwards = 0

        def forward(*args, **kwargs):
            nonlocal forwards
            forwards += 1
            return self._forward(*args, **kwargs)

        stats = [walk_samples(forward, self.models.target.model, turns[t], block_size=B, stop_ids=self.data.stop_ids,
                              token_budget=self.settings.token_budget, temperatures=(t,), device=self.device)
                 for t in temperatures]
        most = torch.tensor(forwards, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        if int(most) > forwards:  # the target is whole here (sampled_temperatures): its forward is local
            self._repeat_forwards(int(most) - forwards, self._stand_in())
        total = torch.cat([s.to_tensor(self.device) for s in stats])
        dist.all_reduce(total)
        record = {}
        for t, part in zip(temperatures, total.chunk(len(temperatures)), strict=True):
            metrics = WalkStats.from_tensor(part, B, (t,)).metrics()
            record.update({tau_key(t): metrics[tau_key(t)], stderr_key(t): metrics[stderr_key(t)]})
        return record

    def _prompts(self) -> list[list[int]]:
        """The prompts of the first --eval-sample-turns held-out turns (their history as in the data)."""
        from dflash.decoding.speculate import prompts_from_samples

        d = self.data
        return prompts_from_samples((d.maker.store[int(i)] for i in d.eval_idx), self.options.eval_sample_turns)

    def _fingerprint(self, prompts, limit: int) -> dict:
        """What the sampled turns depend on, besides the temperature (a resumed run reuses them only if
        it is the same)."""
        digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
        return {"target": str(self.settings.target), "prompts": digest, "turns": len(prompts),
                "seed": self.settings.seed,
                "max_new_tokens": limit, "stop_ids": sorted(int(i) for i in self.data.stop_ids)}

    def sampled_turns(self, temperature: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """This rank's share (turn k on rank k mod world size) of the held-out turns sampled at
        `temperature`, as (ids, loss mask) samples: the prompt of each of the first --eval-sample-turns
        held-out turns, continued by the target alone at T (`dflash.decoding.speculate.sample_turns`, turn
        k seeded with `turn_seed(seed, T, k)`, at most the data's turn limit, to the first stop token).
        They do not depend on the drafter: sampled at the first call (collective), then kept, and
        written by rank 0 to the run folder's eval_turns.json, which a resumed run reads back."""
        if temperature not in self._turns:
            from dflash.decoding.speculate import DEFAULT_MAX_NEW_TOKENS

            prompts = self._prompts()
            fingerprint = self._fingerprint(prompts, self.data.turn_limit or DEFAULT_MAX_NEW_TOKENS)
            outs = self._read_turns(temperature, fingerprint)
            if outs is None:
                outs = self._sample(temperature, prompts, fingerprint)
            rank, world_size = dist.get_rank(), dist.get_world_size()
            self._sampled_count = len(prompts)
            self._turns[temperature] = [
                (np.asarray(prompts[k] + outs[k], dtype=np.int64),
                 np.asarray([False] * len(prompts[k]) + [True] * len(outs[k]), dtype=np.bool_))
                for k in range(rank, len(prompts), world_size)]
        return self._turns[temperature]

    def _read_turns(self, temperature: float, fingerprint: dict) -> list[list[int]] | None:
        """The turns sampled at `temperature` that eval_turns.json holds for this fingerprint (rank 0
        reads, every rank gets them), or None."""
        found = [None]
        path = RunPaths(self.settings.output_dir).eval_turns
        if dist.get_rank() == 0 and path.is_file():
            try:
                saved = json.loads(path.read_text())
            except (OSError, ValueError):
                saved = {}
            if saved.get("fingerprint") == fingerprint:
                found[0] = saved.get("turns", {}).get(f"{temperature:g}")
            if found[0] is not None:
                self.say(f"eval: tau@{temperature:g} walks the {len(found[0])} held-out turns sampled at "
                         f"temperature {temperature:g} in {path}")
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def _sample(self, temperature: float, prompts, fingerprint: dict) -> list[list[int]]:
        """Every rank samples its share of the turns, all ranks get them all; rank 0 keeps them in
        eval_turns.json (a file it cannot write is said, and the turns are sampled again on a resume)."""
        from dflash.decoding.sampling import Sampling
        from dflash.decoding.speculate import sample_turns
        from dflash.errors import os_reason
        from dflash.partial import replace_file

        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.say(f"eval: sampling {len(prompts)} held-out turns at temperature {temperature:g} with the target "
                 f"alone (once per run; tau@{temperature:g} walks them, --eval-sample-turns)")
        mine = range(rank, len(prompts), world_size)
        outs = sample_turns(self.models.target.hf, [prompts[k] for k in mine],
                            [turn_seed(self.settings.seed, temperature, k) for k in mine],
                            sampling=Sampling(temperature),
                            max_new_tokens=fingerprint["max_new_tokens"], stop_ids=self.data.stop_ids,
                            progress=self.settings.progress and rank == 0)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, outs)
        turns = [None] * len(prompts)
        for r, part in enumerate(gathered):
            turns[r::world_size] = part
        if rank == 0:
            path = RunPaths(self.settings.output_dir).eval_turns
            try:
                saved = json.loads(path.read_text()) if path.is_file() else {}
            except (OSError, ValueError):
                saved = {}
            kept = saved.get("turns", {}) if saved.get("fingerprint") == fingerprint else {}
            content = {"fingerprint": fingerprint, "turns": {**kept, f"{temperature:g}": turns}}
            try:
                replace_file(path, [json.dumps(content).encode()])
            except OSError as err:
                self.say(f"eval: could not keep the sampled turns in {path} ({os_reason(err, path)}); a resumed run "
                         "samples them again")
        return turns

    def temperature_note(self) -> str | None:
        """Once: what tau@T walks at each temperature of --eval-temperatures."""
        t = self.data.data_temperature
        sampled = self.sampled_temperatures()
        others = [x for x in self.options.eval_temperatures if x > 0 and x != t and x not in sampled]
        if self._noted or not (others or sampled) or self.data.eval_idx.size == 0:
            return None
        self._noted = True
        notes = []
        if sampled:
            keys = ", ".join(f"tau@{x:g}" for x in sampled)
            notes.append(f"note: {keys} walk {self._sampled_count} held-out prompts continued by the target at each "
                         "temperature T (the expected acceptance of speculative decoding at T on those prompts, "
                         "+- tau@T_stderr over turns); tau walks the data's turns")
        if others:
            origin = ("of unknown origin (no meta.temperature)" if t is None else
                      "regenerated greedily" if t == 0 else f"sampled at temperature {t:g}")
            notes.append(f"note: the held-out turns are {origin}; {', '.join(f'tau@{x:g}' for x in others)} follow "
                         "them, the acceptance decoding would have on them, exact for decoding at T only on turns "
                         "sampled at T (" + ("a partitioned target does not sample them"
                                             if self.settings.partitioned
                                             else "--eval-sample-turns N > 0 samples them")
                         + "; docs/ARCHITECTURE.md)")
        return "\n".join(notes)

    def speculate_heldout(self, drafter_dir: Path, step: int, output: Path, turns: int) -> dict:
        """Greedy speculative decoding of the first `turns` held-out turns with the exported drafter
        (call on one rank): the acceptance length decoding reaches, to set beside the eval walk tau;
        written to `output` as JSON, and said."""
        from dflash.decoding.speculate import DEFAULT_MAX_NEW_TOKENS, prompts_from_samples, speculate
        from dflash.drafter.network import DFlashDrafter

        d, target = self.data, self.models.target
        prompts = prompts_from_samples((d.maker.store[int(i)] for i in d.eval_idx), turns)
        drafter = DFlashDrafter.from_pretrained(drafter_dir, target.model.shared_weights())
        drafter.to(self.device, self.dtype).eval()
        limit = d.turn_limit or DEFAULT_MAX_NEW_TOKENS
        report = speculate(target.hf, drafter, prompts, max_new_tokens=limit, stop_ids=d.stop_ids,
                           reference=False, progress=self.settings.progress).summary()
        result = {"step": step, "max_new_tokens": limit, **report}
        output.write_text(json.dumps(result, indent=2) + "\n")
        turns = f"{report['turns']} held-out turn{'s' * (report['turns'] != 1)}"
        self.say(f"speculative decoding of {turns}: acceptance length "
                 f"{report['acceptance_length']:.3f} ({report['tokens']:,} tokens, {report['target_forwards']:,} "
                 f"target forwards after the prefills, {report['speculative_tokens_per_s']:.0f} tokens/s); "
                 f"against the target alone: python launch/speculate.py --drafter {drafter_dir}")
        return result
