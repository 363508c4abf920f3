"""Decoding with the target alone, and lossless DFlash speculative decoding (target + drafter),
greedy or sampled at a temperature (`dflash.decoding.sampling`: the engines' ratio test).

Speculative decoding of one turn (the DFlash paper's loop, as in the official `dflash_generate`):
the target's prefill gives the first token and the tapped features of the prompt. Each step the
drafter drafts one block [last verified token, mask x (B-1)] at positions start..start+B-1 in one
forward, attending to the fused features of every verified token before `start` (its KV cache) and
to the whole block; the target verifies the block in one forward (its cache then kept at the
accepted length: `TargetCache` crops attention layers and restores recurrent ones),
the leading drafts equal to the target's argmax are accepted, and the target's next token is added.
The verified tokens' features become the drafter's new context. Output is the target's greedy output.
The drafter runs its one forward (`DFlashDrafter.draft`, the training forward with a `DrafterCache`);
a network that chooses its drafts (`chooses_drafts`: a candidate selector) proposes them (`draft_block`).
Sampled (temperature > 0): the drafts are drawn from the drafter's distribution and verified by the
ratio test (`Sampler`); the output is distributed as the target's own sampling, not equal to it.

Acceptance length = tokens after the first / verify forwards, summed over turns, with a turn's last
block cut at its stop token or the token limit: exactly the walk `tau` of `dflash.decoding.acceptance`
on the target's own greedy turns (the official benchmark averages uncut blocks instead).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash.decoding.sampling import Sampler, Sampling
from dflash.decoding.target_cache import TargetCache
from dflash.drafter.network import DFlashDrafter, DrafterCache

DEFAULT_MAX_NEW_TOKENS = 2048  # per turn, when the data do not say what they were regenerated with


@dataclass
class Decoded:
    tokens: list[int]  # generated ids: stop token included when produced, at most max_new_tokens
    forwards: int  # target forwards after the prefill (speculative: blocks verified)
    seconds: float  # wall time of the whole turn, prefill included
    accepted: list[int] = field(default_factory=list)  # speculative: drafts accepted per verify forward


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cut(tokens: list[int], stop_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Tokens up to the first stop token (included) or the limit; True when decoding is over."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[:i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.no_grad()
def greedy_decode(hf, prompt: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int],
                  sampler: Sampler | None = None) -> Decoded:
    """The target alone, one token per forward with a KV cache (the reference output); greedy, or
    sampled by `sampler`."""
    sampler = sampler or Sampler()
    _sync(hf.device)
    t0 = time.perf_counter()
    cache = TargetCache(hf)
    out = cache.forward(list(prompt))
    tokens = [sampler.next_token(out.logits[0, -1])]
    forwards = 0
    while not _cut(tokens, stop_ids, max_new_tokens)[1]:
        out = cache.forward(tokens[-1:])
        tokens.append(sampler.next_token(out.logits[0, -1]))
        forwards += 1
    _sync(hf.device)
    return Decoded(tokens, forwards, time.perf_counter() - t0)


def draft_block(drafter: DFlashDrafter, sampler: Sampler, cache: DrafterCache, features: torch.Tensor,
                anchor: int) -> tuple[list[int], torch.Tensor | None]:
    """One block's drafts and their proposal q (B-1, V) (None when greedy): a DFlash drafter's slots
    independently (`Sampler.draft`), or those its network proposes (`propose`: a candidate selector's path),
    each slot's q over its candidates conditioned on the drafts before it (what the ratio test needs)."""
    if not drafter.chooses_drafts:
        return sampler.draft(drafter.draft(cache, features, anchor))
    s = sampler.sampling
    sampled = not s.greedy and s.drafts == "sampled"
    path, candidates, q = drafter.propose(drafter.draft_hidden(cache, features, anchor), anchor,
                                          s.temperature if sampled else 0.0, sampler.generator)
    if s.greedy:
        return path.tolist(), None
    full = torch.zeros(path.shape[0], drafter.config.vocab_size, device=path.device)
    if sampled:
        return path.tolist(), full.scatter_(1, candidates, q)
    return path.tolist(), full.scatter_(1, path[:, None], 1.0)  # argmax drafts: the greedy path, q one-hot


@torch.no_grad()
def speculative_decode(
    hf, drafter: DFlashDrafter, prompt: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int],
    sampler: Sampler | None = None,
) -> Decoded:
    """Speculative decoding of one turn, fewer target forwards: greedy (the target's greedy output), or
    sampled by `sampler` (distributed as the target's own sampling).

    hf: the target's Hugging Face causal LM (any `TargetModel` family: its cache is rolled back
    to the accepted length by `TargetCache`); drafter: attached to its embedding and lm_head.
    """
    taps = drafter.config.target_layer_ids
    B = drafter.block_size

    def features(out, n):
        return torch.cat([out.hidden_states[i + 1][0, :n] for i in taps], dim=-1)

    sampler = sampler or Sampler()
    _sync(hf.device)
    t0 = time.perf_counter()
    cache = TargetCache(hf)
    out = cache.forward(list(prompt), hidden=True)
    tokens = [sampler.next_token(out.logits[0, -1])]
    dcache = DrafterCache(drafter, len(prompt) + max_new_tokens + B)
    feats = features(out, len(prompt))
    forwards, steps = 0, []
    while not _cut(tokens, stop_ids, max_new_tokens)[1]:
        start = len(prompt) + len(tokens) - 1  # position of the last verified token, the anchor
        drafts, q = draft_block(drafter, sampler, dcache, feats, tokens[-1])
        out = cache.forward(tokens[-1:] + drafts, hidden=True)
        forwards += 1
        accepted, following = sampler.verify(drafts, q, out.logits[0])
        steps.append(accepted)
        tokens += drafts[:accepted] + [following]
        cache.keep(start + accepted + 1)
        feats = features(out, accepted + 1)
    _sync(hf.device)
    tokens, _ = _cut(tokens, stop_ids, max_new_tokens)
    return Decoded(tokens, forwards, time.perf_counter() - t0, steps)


@dataclass
class SpeculateReport:
    turns: int = 0
    tokens: int = 0  # generated by target + drafter, all turns
    target_forwards: int = 0  # speculative: verify forwards after the prefills
    target_seconds: float = 0.0
    speculative_seconds: float = 0.0
    mismatches: list[int] = field(default_factory=list)  # greedy: turns whose output differs (must be empty)
    reference: bool = True  # the target alone ran too (tokens/s, speedup and, greedy, the lossless check)
    reference_tokens: int = 0  # generated by the target alone (sampled: other tokens than the speculative run's)
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None  # of the sampled runs
    turn_tokens: list[int] = field(default_factory=list)  # per turn: tokens after the first
    turn_forwards: list[int] = field(default_factory=list)  # per turn: verify forwards
    turn_accepted: list[list[int]] = field(default_factory=list)  # per turn: drafts accepted per verify forward
    outputs: list[list[int]] = field(default_factory=list)  # per turn: the speculative output
    reference_outputs: list[list[int]] = field(default_factory=list)  # per turn: the target alone's

    def add(self, spec: Decoded) -> None:
        self.turns += 1
        self.tokens += len(spec.tokens)
        self.target_forwards += spec.forwards
        self.speculative_seconds += spec.seconds
        self.turn_tokens.append(len(spec.tokens) - 1)
        self.turn_forwards.append(spec.forwards)
        self.turn_accepted.append(spec.accepted)
        self.outputs.append(spec.tokens)

    @property
    def acceptance_length(self) -> float:
        """Tokens after each turn's first per verify forward (= walk tau on these turns)."""
        return (self.tokens - self.turns) / self.target_forwards if self.target_forwards else 1.0

    @property
    def acceptance_length_stderr(self) -> float | None:
        """Sampled runs: the standard error of `acceptance_length`, a ratio of sums over turns (delta
        method: sqrt(sum (t_i - tau f_i)^2 / (n (n-1))) / mean f, t_i tokens and f_i forwards of turn i).
        It counts the spread between prompts as noise too, so it overstates the error of a rerun of the
        same prompts. None when greedy (deterministic) or with fewer than 2 turns."""
        n = len(self.turn_forwards)
        if self.sampling.greedy or n < 2 or not self.target_forwards:
            return None
        t = torch.tensor(self.turn_tokens, dtype=torch.float64)
        f = torch.tensor(self.turn_forwards, dtype=torch.float64)
        residual = t - self.acceptance_length * f
        return float((residual.square().sum() / (n * (n - 1))).sqrt() / f.mean())

    def summary(self) -> dict:
        """The figures; without the reference run, those that need it are None."""
        target_tps = self.reference_tokens / self.target_seconds if self.reference and self.target_seconds else None
        spec_tps = self.tokens / self.speculative_seconds if self.speculative_seconds else 0.0
        greedy = self.sampling.greedy
        return {
            "acceptance_length": self.acceptance_length,
            "acceptance_length_stderr": self.acceptance_length_stderr,
            "target_tokens_per_s": target_tps,
            "speculative_tokens_per_s": spec_tps,
            "speedup": spec_tps / target_tps if target_tps else None,
            # sampled: lossless in distribution, shown by tests (tests/decoding/test_speculative_sampling.py)
            "lossless": not self.mismatches if self.reference and greedy else None,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "drafts": None if greedy else self.sampling.drafts,
            "seed": None if greedy else self.seed,
            "turns": self.turns,
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "reference_tokens": self.reference_tokens if self.reference else None,
            "mismatched_turns": self.mismatches,
        }


def speculate(hf, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
              stop_ids: Sequence[int], reference: bool = True, progress: bool = True,
              sampling: Sampling | None = None, seed: int = 0) -> SpeculateReport:
    """Decode every prompt with target + drafter and, with `reference`, with the target alone
    (alternating, so machine load hits both alike). Greedy: the outputs are compared token for token.
    Sampled (`sampling` at a temperature > 0): each of the two runs draws from its own generator seeded
    with `seed`, so their outputs differ; they are equal in distribution (tested, not checked here)."""
    from tqdm.auto import tqdm

    sampling = sampling or Sampling()
    report = SpeculateReport(reference=reference, sampling=sampling, seed=seed)
    spec_sampler, ref_sampler = (Sampler(sampling, seed, hf.device) for _ in range(2))
    for i, prompt in enumerate(tqdm(prompts, desc="decode", unit="turn", disable=not progress)):
        limit = decode_limit(hf, prompt, max_new_tokens)
        spec = speculative_decode(hf, drafter, prompt, max_new_tokens=limit, stop_ids=stop_ids, sampler=spec_sampler)
        report.add(spec)
        if reference:
            ref = greedy_decode(hf, prompt, max_new_tokens=limit, stop_ids=stop_ids, sampler=ref_sampler)
            report.target_seconds += ref.seconds
            report.reference_tokens += len(ref.tokens)
            report.reference_outputs.append(ref.tokens)
            if sampling.greedy and spec.tokens != ref.tokens:
                report.mismatches.append(i)
    return report


def decode_limit(hf, prompt: Sequence[int], max_new_tokens: int) -> int:
    """The token limit of one turn: `max_new_tokens`, or fewer where the target's positions end (a
    target without an end-of-turn habit stops at its last position, not past it)."""
    positions = getattr(hf.config, "max_position_embeddings", None)
    return min(max_new_tokens, positions - len(prompt)) if positions else max_new_tokens


def sample_turns(hf, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, sampling: Sampling,
                 max_new_tokens: int, stop_ids: Sequence[int], progress: bool = False) -> list[list[int]]:
    """The target's own continuation of each prompt, sampled at `sampling` by the target alone
    (`greedy_decode` with a `Sampler`), prompt i with its own generator seeded with seeds[i] (so a
    turn does not depend on which others are sampled with it); each ends as decoding's would, at
    its first stop token or the turn's limit (`decode_limit`)."""
    from tqdm.auto import tqdm

    return [greedy_decode(hf, prompt, max_new_tokens=decode_limit(hf, prompt, max_new_tokens), stop_ids=stop_ids,
                          sampler=Sampler(sampling, seed, hf.device)).tokens
            for prompt, seed in tqdm(list(zip(prompts, seeds, strict=True)), desc=f"sample T={sampling.temperature:g}",
                                     unit="turn", disable=not progress)]


def prompts_from_samples(samples, max_turns: int | None = None) -> list[list[int]]:
    """The prompt of every assistant turn of tokenized samples `(ids, loss_mask)`: the tokens before
    the turn's first supervised token (its history as in the data, up to the generation prompt)."""
    from dflash.decoding.acceptance import turn_spans

    prompts = []
    for ids, mask in samples:
        prompts += [list(map(int, ids[:start])) for start, _ in turn_spans(mask)]
    return prompts[:max_turns]


def prompts_from_conversations(path, tokenizer) -> list[list[int]]:
    """The prompt of every assistant turn of a JSONL file (`messages` or ShareGPT), rendered with the
    tokenizer's chat template and the file's own history; a conversation that ends with a user turn
    gives one more prompt."""
    from dflash.data.conversations import read_conversations

    prompts = []
    for _, messages, _ in read_conversations(path, require_assistant=False):
        ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if messages[-1]["role"] == "user":
            ends.append(len(messages))
        for i in ends:
            text = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts
