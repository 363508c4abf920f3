"""Whether a run fits the memory a rank has: that memory (`--memory-gib` or the GPU's), the
allocator setting, the row budget that fits or the refusal naming the flags that would make it fit,
and the one-line stop of a step that ran out of memory anyway."""
from __future__ import annotations

from dataclasses import replace

from dflash.errors import UserError
from dflash.sizing.memory import GIB, RESERVE_BYTES, RESERVE_FRACTION, MemoryPlan, describe, gib


def accelerator_memory(device, memory_gib: float) -> int | None:
    """Bytes per rank the run must fit in: --memory-gib, else a GPU's total; None on the CPU (no limit)."""
    import torch

    if memory_gib:
        return int(memory_gib * GIB)
    if torch.device(device).type == "cuda":
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return None


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"
_SET_HERE: list[str] = []  # the setting this process made (so a second call still says whose it is)


def cuda_allocator(environ, device) -> str | None:
    """On CUDA, PyTorch's allocator with expandable segments (late-run fragmentation is what runs out of
    memory after hours with a plan that fits), unless the user set their own (PYTORCH_CUDA_ALLOC_CONF or
    torch's newer PYTORCH_ALLOC_CONF); the run header's line on it. None elsewhere."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    if not _SET_HERE:
        for name in ("PYTORCH_ALLOC_CONF", ALLOC_CONF):
            if environ.get(name):
                return f"CUDA allocator: {name}={environ[name]} (yours, kept)"
        environ[ALLOC_CONF] = EXPANDABLE
        _SET_HERE.append(EXPANDABLE)
        if torch.cuda.is_initialized():  # the allocator may have read its settings already
            torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    return (f"CUDA allocator: {ALLOC_CONF}={EXPANDABLE} (set by dflash against fragmentation late in a run; "
            f"set {ALLOC_CONF} yourself to choose another)")


def out_of_memory(plan: MemoryPlan, memory: int | None, *, step: int, shape: tuple[int, int, int] | None,
                  row_budget: int, token_budget: int, checkpoint: str | None) -> str:
    """The one line a run stops with when a step runs out of memory: where, what the plan said, what to
    lower, and the checkpoint to resume from. `shape`: (tokens, rows, row_keys) of the micro-batch that
    ran out, None for the optimizer step."""
    where = "in the optimizer step" if shape is None else \
        f"in a micro-batch of {shape[0]:,} tokens and {shape[1]:,} drafter rows"
    if shape is None:
        planned = ""
    else:
        limit = f" of {gib(plan.usable(memory))} usable" if memory else ""
        planned = f" (the memory plan: {gib(plan.peak(*shape)['total'])} per rank{limit})"
    flag = f"lower --row-budget (now {row_budget:,})" if row_budget else \
        f"give a --row-budget below {shape[1]:,}" if shape else "use --deepspeed_config ds_configs/zero3.json"
    resume = f"the last checkpoint, {checkpoint}, is intact: rerun with --resume" if checkpoint else \
        "no checkpoint was written yet"
    return (f"step {step}: out of memory {where}{planned}; {flag} or --token-budget (now {token_budget:,}), or add "
            f"--activation-checkpointing; {resume}")


def _alternatives(plan: MemoryPlan, memory: int, tokens: int, longest: int | None = None) -> list[str]:
    """Changes of one flag that make the run fit, each with its estimated peak; no token budget below
    `longest` (the longest sample, where known: a budget it exceeds is refused for it)."""
    s, rows = plan.setup, plan.min_rows()
    found = []

    def fits(p: MemoryPlan, t: int = tokens) -> bool:
        return p.rows_that_fit(memory, t) >= p.min_rows()

    if s.target_partition == "none" and fits(plan.partitioned()):
        found.append(f"--target-partition zero3 (peak {gib(plan.partitioned().peak(tokens, rows)['total'])})")
    if not s.activation_checkpointing and fits(MemoryPlan(plan.target, plan.drafter,
                                                          replace(s, activation_checkpointing=True))):
        found.append("--activation-checkpointing")
    budget = plan.tokens_that_fit(memory, rows)
    if budget and (longest is None or budget >= longest):
        found.append(f"--token-budget {budget:,} or less" if longest is None else
                     f"--token-budget {budget:,} (down to the longest sample's {longest:,} tokens)")
    anchors = next((a for a in (256, 128, 64, 32, 16) if a < s.num_anchors and
                    fits(MemoryPlan(plan.target, plan.drafter, replace(s, num_anchors=a)))), None)
    if anchors:
        found.append(f"--num-anchors {anchors}")
    if s.zero_stage < 3 and fits(MemoryPlan(plan.target, plan.drafter, replace(s, zero_stage=3, bucket_elements=0))):
        found.append("--deepspeed_config ds_configs/zero3.json (the drafter's weights and state partitioned too)")
    return found or _pairs(plan, memory, tokens, longest)


def _pairs(plan: MemoryPlan, memory: int, tokens: int, longest: int | None) -> list[str]:
    """When no one flag is enough: two changes together that make the run fit (fewer anchors or a
    smaller token budget with one of the others), so a refusal always says what would fit when
    anything would."""
    s = plan.setup
    changes = [(flags, fields) for flags, fields, holds in (
        ("--target-partition zero3", {"target_partition": "zero3"}, s.target_partition == "none"),
        ("--activation-checkpointing", {"activation_checkpointing": True}, not s.activation_checkpointing),
        ("--deepspeed_config ds_configs/zero3.json", {"zero_stage": 3, "bucket_elements": 0}, s.zero_stage < 3),
        ("", {}, True)) if holds]
    found = []
    for flags, fields in changes:
        for anchors in [a for a in (256, 128, 64, 32, 16) if a < s.num_anchors] + [s.num_anchors]:
            p = MemoryPlan(plan.target, plan.drafter, replace(s, **fields, num_anchors=anchors))
            both = [flags] if flags else []
            both += [f"--num-anchors {anchors}"] if anchors != s.num_anchors else []
            if not both:
                continue
            if p.rows_that_fit(memory, tokens) >= p.min_rows():
                found.append(" ".join(both))
                break
            budget = p.tokens_that_fit(memory, p.min_rows())
            if budget and (longest is None or budget >= longest):
                found.append(" ".join([*both, f"--token-budget {budget:,}"]))
                break
    return found[:4]


def size_run(plan: MemoryPlan, memory: int | None, *, token_budget: int, row_budget: int,
             longest: int | None = None) -> tuple[int, str]:
    """The row budget to plan with and the header's line on memory; refuses (UserError) a run that
    cannot fit: what needs how much, and which flags would make it fit (`longest`: the longest
    sample, where known before anything loads)."""
    rows = max(row_budget, plan.min_rows())
    if memory is None:
        peak = plan.peak(token_budget, rows)
        return row_budget, (f"memory plan (per rank, tensor bytes): {gib(peak['total'])} at {token_budget:,} tokens "
                            f"and {rows:,} drafter rows (+{gib(plan.per_row() * 1000)} per 1,000 rows); row budget "
                            f"{f'{row_budget:,} (--row-budget)' if row_budget else 'none'}: no memory limit to plan "
                            "against (a CPU run without --memory-gib)")
    usable, fit = plan.usable(memory), plan.rows_that_fit(memory, token_budget)
    if fit < rows:
        peak = plan.peak(token_budget, rows)
        ceiling = plan.anchor_ceiling(memory, token_budget)
        asked = f"--row-budget {row_budget:,}" if row_budget > plan.min_rows() else \
            (f"one sample's {rows:,} drafter rows (--block-size x --num-anchors {plan.setup.num_anchors:,}; the most "
             f"anchors a sample of {token_budget:,} tokens fits: {ceiling:,})")
        ways = _alternatives(plan, memory, token_budget, longest)
        raise UserError(
            f"memory plan: this run needs about {gib(peak['total'])} per rank, more than the {gib(usable)} usable "
            f"of {gib(memory)} (--memory-gib; {RESERVE_FRACTION:.0%} and {gib(RESERVE_BYTES)} kept free for the CUDA "
            f"context, communication and fragmentation) with --token-budget {token_budget:,} and {asked}:\n  "
            + describe(peak).replace("; ", "\n  ")
            + ("\nit would fit with: " + "; or ".join(ways) if ways else "")
            + "\n(estimate: launch/plan_memory.py; nothing was loaded)")
    chosen = row_budget or fit
    why = "--row-budget" if row_budget else "the most that fits by the memory plan"
    peak = plan.peak(token_budget, chosen)
    return chosen, (f"memory plan (per rank): {gib(peak['total'])} of {gib(usable)} usable ({gib(memory)}) at "
                    f"{token_budget:,} tokens and {chosen:,} drafter rows; row budget {chosen:,} ({why})")
