#!/usr/bin/env python
"""Speculative decoding with a trained DFlash drafter: acceptance length, speed, and proof it is lossless.

  python launch/speculate.py [--drafter DIR] [--prompts F.jsonl] [--target DIR] [--json]
                             [--temperature T [--top-p P] [--seed S] [--drafts sampled|argmax]]

Every prompt is decoded twice, by the target alone and by target + drafter (blocks of the drafter's
block size, KV caches for both, the verified tokens' target features fed back as the drafter's
context). Reported: the acceptance length (target tokens per target forward after the prefill),
tokens/s of both and the speedup. Greedy (the default, --temperature 0): whether every output is
identical (it must be). Sampled (--temperature T > 0): speculative sampling as the serving engines
verify DFlash blocks: every slot's draft is drawn from the drafter's softmax at T (vLLM's
probabilistic drafts; --drafts argmax: its argmax, as SGLang's DFlash and vLLM's default), accepted
with probability min(1, p/q), the first rejected slot resampled from max(0, p - q) renormalised, a
bonus token from p after a fully accepted block; p is the target's distribution at T cut to its
top-p nucleus. The output is distributed as the target's own sampling (tests/decoding/
test_speculative_sampling.py shows it), so the two runs' outputs differ; the acceptance length
comes with its standard error.

Without --prompts the turns are the held-out assistant turns of the run the drafter came from
(DIR/../config.json and its token store, the same split as the run's evaluation), and the eval
walk is computed on them too: `tau` (greedy; on greedy regenerated data the two agree) and, when
sampling, `tau@T`, the expected acceptance at T along those turns (it predicts the sampled run
when the turns themselves were sampled at T, e.g. by `launch/regenerate.py --temperature T`).
With --prompts, a file that holds assistant turns gets the same walk on its turns; --save-heldout
writes the run's held-out conversations, to regenerate at T and decode that way. With no
arguments at all: the demo target, runs/demo/drafter and the demo's held-out turns.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from dflash.errors import UserError, exit_on_user_error
from dflash.folders import check_drafter_folder
from dflash.options import number


def parse_args(argv=None):
    from dflash.decoding.sampling import DRAFTS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="runs/demo/drafter",
                   help="exported drafter folder (default: runs/demo/drafter)")
    p.add_argument("--prompts", help="JSONL conversations (`messages`): every assistant turn is decoded with the "
                   "file's history, and a conversation ending with a user turn gets one response (default: the "
                   "held-out turns of the drafter's run)")
    p.add_argument("--target", help="the target: a Hugging Face model folder, a Hub id or a .gguf file (default: the "
                                    "run's target; with --prompts, the target the drafter records, else the demo "
                                    "target when the drafter fits it)")
    p.add_argument("--max-new-tokens", type=number(int, minimum=1),
                   help="limit per turn (default: the limit the data was regenerated "
                   "with, meta.max_new_tokens, else 2048)")
    p.add_argument("--max-turns", type=number(int, minimum=1), help="decode only the first N turns")
    p.add_argument("--temperature", type=number(float, minimum=0), default=0.0,
                   help="0: greedy decoding, outputs checked token for token (default); > 0: speculative sampling "
                   "at this temperature (lossless in distribution)")
    p.add_argument("--top-p", type=number(float, above=0, maximum=1), default=1.0,
                   help="when sampling: the target's nucleus (default 1: the whole vocabulary); the drafts use the "
                   "temperature only, as vLLM's")
    p.add_argument("--seed", type=number(int, minimum=0),
                   help="when sampling: seed of both runs' random draws (default 0)")
    p.add_argument("--drafts", choices=DRAFTS, default="sampled",
                   help="when sampling: sampled (default): every slot drawn from the drafter's softmax at the "
                   "temperature (vLLM draft_sample_method=probabilistic); argmax: the drafter's argmax, q one-hot "
                   "(SGLang's DFlash, vLLM's default greedy drafts)")
    p.add_argument("--save-heldout", metavar="F.jsonl",
                   help="write the held-out conversations of the drafter's run (their lines of the run's JSONL "
                   "data) to F.jsonl and stop: regenerate them at a temperature (launch/regenerate.py "
                   "--temperature T) and decode them with --prompts, where the walk's tau@T is exact in expectation")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--engine", choices=("vllm",),
                   help="vllm: also serve the drafter with its target in vLLM (bash launch/install.sh serve) on the "
                   "same turns and print its spec-decode metrics beside dflash's: mean acceptance length, accepted "
                   "drafts per position, greedy outputs against the target alone's")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p.parse_args(argv)


def sampling_options(args):
    """(Sampling, seed) from the flags; sampling flags without a temperature are refused."""
    from dflash.decoding.sampling import Sampling

    if args.temperature == 0:
        given = [flag for flag, on in (("--top-p", args.top_p != 1.0), ("--seed", args.seed is not None),
                                       ("--drafts", args.drafts != "sampled")) if on]
        if given:
            one = len(given) == 1
            raise UserError(f"{' and '.join(given)} {'applies' if one else 'apply'} only to sampling: give "
                            f"--temperature > 0 or leave {'it' if one else 'them'} out")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.drafts)
    except ValueError as e:
        raise UserError(f"--temperature {args.temperature} --top-p {args.top_p}: {e}") from None
    return sampling, 0 if args.seed is None else args.seed


def run_heldout(drafter_dir: Path):
    """(target path, tokenized held-out samples, their turn limit, the temperature they were regenerated
    at) of the run the drafter came from: its store and split, found as the run found them."""
    from dflash.data.token_store import TokenStore
    from dflash.distributed.run_folder import RunPaths
    from dflash.training.config import load_run
    from dflash.training.data import data_temperature, held_out_split, store_path, turn_limit

    paths = RunPaths.of_drafter(drafter_dir)
    if not paths.config.is_file():
        raise UserError(f"--drafter {drafter_dir}: no run config {paths.config} to find its held-out turns; "
                        "give --prompts")
    cfg = load_run(paths.root)
    data = Path(cfg.inputs.data)
    store = TokenStore(store_path(data, paths.root))
    _, eval_idx = held_out_split(len(store), cfg.inputs.eval_fraction, cfg.run.seed)
    if eval_idx.size == 0:
        raise UserError(f"{paths.config}: the run held nothing out (eval_fraction 0); give --prompts")
    return (Path(cfg.inputs.target), [store[int(i)] for i in eval_idx], turn_limit(store, data),
            data_temperature(store, data))


def real_bench_target() -> Path | None:
    """The real benchmark's target where its wheel is installed, else None."""
    from dflash.bench_real import target_gguf

    try:
        return target_gguf()
    except UserError:
        return None


def recorded_target(drafter_dir: Path) -> str:
    """The target to decode `--prompts` with when --target is not given: the one the drafter's export
    records (`TARGET_KEY`: by its name as given, else its path), found here; a drafter that records
    none, the demo target when it fits it. Otherwise one line: --target is missing, and which target
    the drafter was trained on."""
    from dflash.demo import TARGET
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.config_format import TARGET_KEY
    from dflash.identity import target_identity
    from dflash.target.spec import load_target_spec

    raw = json.loads((drafter_dir / "config.json").read_text())
    record = raw.get(TARGET_KEY)
    if isinstance(record, dict):
        for name in (record.get("name"), record.get("path")):
            if name and Path(name).exists():
                return name
        real = real_bench_target()  # the real benchmark's drafter names its .gguf, found here by content
        if real is not None and record.get("sha256") == target_identity(real.parent, real.name, str(real))["sha256"]:
            return str(real)
        raise UserError(f"--target is missing: --drafter {drafter_dir} was trained on {record.get('name')} "
                        f"({record.get('model_type')}, {record.get('num_hidden_layers')} layers), which is not here; "
                        "give its path or Hub id with --target")
    config, demo = DrafterConfig.from_json_dict(raw), load_target_spec(str(TARGET))
    if (config.num_target_layers, config.hidden_size) != (demo.num_layers, demo.hidden_size):
        raise UserError(f"--target is missing: --drafter {drafter_dir} records no target; it was trained on one of "
                        f"{config.num_target_layers} layers (num_target_layers) and hidden size "
                        f"{config.hidden_size}, not the demo target ({demo.num_layers} layers, hidden size "
                        f"{demo.hidden_size}) used without --target: give its target with --target")
    return str(TARGET)


def save_heldout(drafter_dir: Path, output: Path) -> int:
    """The run's held-out conversations, as lines of its JSONL data, written to `output`."""
    import os

    from dflash.data.token_store import TokenStore
    from dflash.distributed.run_folder import RunPaths
    from dflash.training.config import load_run
    from dflash.training.data import held_out_split, source_file, store_path

    paths = RunPaths.of_drafter(drafter_dir)
    if not paths.config.is_file():
        raise UserError(f"--drafter {drafter_dir}: no run config {paths.config} to find its held-out conversations")
    cfg = load_run(paths.root)
    data = Path(cfg.inputs.data)
    store = TokenStore(store_path(data, paths.root))
    source = source_file(store, data)
    if not source.is_file() or store.meta.get("input_format", "jsonl") != "jsonl":
        raise UserError(f"--save-heldout: the run's data {data} came from no JSONL file that is still there "
                        "(it copies the held-out lines of one)")
    _, eval_idx = held_out_split(len(store), cfg.inputs.eval_fraction, cfg.run.seed)
    lines = source.read_text(encoding="utf-8").splitlines()
    numbers = store.dataset.data.table.column("source_line").to_numpy()[eval_idx]
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(lines[int(n) - 1] + "\n" for n in numbers), encoding="utf-8")
    os.replace(tmp, output)  # whole or not at all
    return len(numbers)


def samples_from_conversations(path, tokenizer) -> list:
    """The conversations of a JSONL file that hold assistant turns, tokenized as the token store does."""
    from dflash.data.conversations import read_conversations
    from dflash.data.tokenizing import tokenize_conversation

    samples = []
    for line, messages, _ in read_conversations(path, require_assistant=False):
        if any(m["role"] == "assistant" for m in messages):
            samples.append(tokenize_conversation(tokenizer, messages, f"{path}:{line}"))
    return samples


def check_positions(prompts, spec, where) -> None:
    """Every prompt leaves the target a position to decode at: one past its positions would decode
    nothing (or what the target was never made for), and the two runs' outputs would say nothing of
    the drafter."""
    positions = spec.positions
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    if positions and len(prompts[longest]) >= positions:
        over = sum(len(p) >= positions for p in prompts)
        raise UserError(f"{where}: turn {longest} has a prompt of {len(prompts[longest]):,} tokens ({over} of "
                        f"{len(prompts)} turns reach past the target's {positions:,} positions, "
                        f"max_position_embeddings of {spec.name}): nothing can be decoded after it; leave those "
                        "conversations out or shorten them (--max-turns decodes only the first turns)")


def check_fits(drafter_dir: Path, config, spec) -> None:
    """The drafter fits the target by their configs (hidden size, vocabulary, taps, depth): refused in
    one line before either's weights load."""
    from dflash.drafter.config import DrafterConfig, check_fits_target

    raw = json.loads((drafter_dir / "config.json").read_text())
    try:
        check_fits_target(config, spec.config, num_target_layers_given=DrafterConfig.gives_num_target_layers(raw))
    except ValueError as e:
        raise UserError(f"--drafter {drafter_dir} does not fit --target {spec.name}: {e}") from None


def load_models(drafter_dir: Path, spec, dtype_option: str):
    import torch

    from dflash.devices import resolve_dtype
    from dflash.drafter.network import DFlashDrafter
    from dflash.training.target import load_target

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(dtype_option, device)
    try:
        drafter = DFlashDrafter.from_pretrained(drafter_dir)
        target = load_target(spec, device, dtype,
                             target_layer_ids=drafter.config.target_layer_ids, mask_token=False)
        drafter.attach(target.model.shared_weights())
    except ValueError as e:
        raise UserError(f"--drafter {drafter_dir} with --target {spec.name}: {e}") from None
    drafter.to(device, dtype).eval()
    return drafter, target, device, dtype


def eval_walk(drafter, target, samples, device, *, limit: int, stops, sampling) -> dict:
    """The eval walk on the decoded turns' data: greedy tau, anchor tau and, when sampling, tau@T."""
    from types import SimpleNamespace

    from dflash.decoding.acceptance import walk_samples
    from dflash.decoding.walk_stats import tau_key
    from dflash.drafter.kinds import drafter_kind
    from dflash.objective.blocks import block_scorer
    from dflash.objective.loss import BlockLoss, default_gamma, slot_weights

    temperatures = (0.0,) if sampling.greedy else (0.0, sampling.temperature)
    B = drafter.block_size
    # the kind's own terms (at their defaults) and logit map, as the trainer's evaluation: a network that
    # chooses its drafts is walked along its own path (`Finished.correct`, `label_logq`)
    kind = drafter_kind(drafter.config.kind)
    scale, softcap = kind.logit_map(drafter.config)
    loss = BlockLoss(terms=kind.terms(drafter, SimpleNamespace()), logit_scale=scale, softcap=softcap)
    score = block_scorer(drafter, loss, drafter.lm_head, mask_token_id=drafter.config.mask_token_id,
                         slot_weights=slot_weights(B, default_gamma(B)))
    walk = walk_samples(score, target.model, samples,
                        block_size=drafter.block_size, max_turn_tokens=limit, stop_ids=stops,
                        temperatures=temperatures, device=device).metrics()
    result = {"walk_tau": walk["tau"], "anchor_tau": walk["anchor_tau"], "walk_turns": walk["turns"]}
    if not sampling.greedy:
        result["walk_" + tau_key(sampling.temperature)] = walk[tau_key(sampling.temperature)]
    return result


def describe(result: dict, *, limit: int, where: str) -> None:
    """The report in words."""
    sampled = result["temperature"] > 0
    print(f"{result['turns']} turns, {result['tokens']:,} tokens (at most {limit} per turn), {where}")
    if sampled:
        print(f"speculative sampling at temperature {result['temperature']:g}, top-p {result['top_p']:g}, "
              f"{result['drafts']} drafts, seed {result['seed']}")
        print(f"acceptance length {result['acceptance_length']:.3f} +- {result['acceptance_length_stderr'] or 0:.3f} "
              "(standard error) target tokens per target forward")
    else:
        print(f"acceptance length {result['acceptance_length']:.3f} target tokens per target forward")
    if "walk_tau" in result:
        line = f"eval walk on the data's {result['walk_turns']} turns: tau {result['walk_tau']:.3f} (greedy)"
        key = f"walk_tau@{result['temperature']:g}"
        if key in result:
            data_t = result.get("data_temperature")
            origin = "of unknown temperature" if data_t is None else f"regenerated at temperature {data_t:g}"
            line += (f", tau@{result['temperature']:g} {result[key]:.3f} (expected acceptance along those turns, "
                     f"{origin}; it predicts this run when they were sampled at {result['temperature']:g})")
        print(line + f", anchor tau {result['anchor_tau']:.3f}")
    print(f"target alone {result['target_tokens_per_s']:.1f} tokens/s, speculative "
          f"{result['speculative_tokens_per_s']:.1f} tokens/s, speedup {result['speedup']:.2f}x")
    if sampled:
        print("lossless in distribution (tests/decoding/test_speculative_sampling.py); the two runs' outputs differ")
    else:
        print("lossless: every output equals the target's greedy output" if result["lossless"] else
              f"NOT LOSSLESS: turns {result['mismatched_turns']} differ from the target's greedy output")


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    out = sys.stdout
    # --json: stdout carries the report alone; what the libraries print (DeepSpeed's accelerator line,
    # vLLM's engine) goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        return _main(args, out)


def _main(args, out):
    sampling, seed = sampling_options(args)

    from dflash.data.generation import regeneration_limit, regeneration_temperature, stop_ids
    from dflash.data.tokenizing import load_tokenizer
    from dflash.decoding.speculate import (
        DEFAULT_MAX_NEW_TOKENS,
        prompts_from_conversations,
        prompts_from_samples,
        speculate,
    )
    from dflash.target.spec import load_target_spec

    drafter_dir = Path(args.drafter)
    if not (drafter_dir / "config.json").is_file():
        hint = " (train the demo first: deepspeed launch/train.py)" if args.drafter == "runs/demo/drafter" else ""
        raise UserError(f"--drafter {drafter_dir}: no exported drafter there (config.json){hint}")
    drafter_config = check_drafter_folder(drafter_dir, "--drafter")  # its weights there, whole, and the config's
    if args.save_heldout:
        count = save_heldout(drafter_dir, Path(args.save_heldout))
        print(f"wrote the {count} held-out conversations of {drafter_dir.parent} to {args.save_heldout}")
        return {"heldout_conversations": count}
    samples = None
    if args.prompts:
        if not Path(args.prompts).is_file():
            raise UserError(f"--prompts {args.prompts}: no such file")
        target_path = Path(args.target or recorded_target(drafter_dir))
        data_limit, data_temperature = regeneration_limit(args.prompts), regeneration_temperature(args.prompts)
    else:
        target_path, samples, data_limit, data_temperature = run_heldout(drafter_dir)
        target_path = Path(args.target or target_path)
    limit = args.max_new_tokens or data_limit or DEFAULT_MAX_NEW_TOKENS
    if limit < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {limit}")

    spec = load_target_spec(str(target_path))  # a folder, a Hub id or a .gguf file; one line if none
    check_fits(drafter_dir, drafter_config, spec)
    # the turns, tokenized and checked against the target's positions, before any weight loads
    tokenizer = load_tokenizer(spec.folder / spec.gguf_file if spec.gguf_file else spec.folder, "--target")
    if args.prompts:
        prompts = prompts_from_conversations(args.prompts, tokenizer)
        # the walk needs every turn decoded: not with --max-turns
        samples = samples_from_conversations(args.prompts, tokenizer) if args.max_turns is None else None
    else:
        prompts = prompts_from_samples(samples)
    prompts = prompts[:args.max_turns]
    if not prompts:
        raise UserError("no turns to decode")
    check_positions(prompts, spec, args.prompts or f"the held-out turns of "
                    f"{drafter_dir.parent}")
    drafter, target, device, dtype = load_models(drafter_dir, spec, args.dtype)
    hf = target.hf
    stops = stop_ids(tokenizer, target.spec.generation_eos())
    report = speculate(hf, drafter, prompts, max_new_tokens=limit, stop_ids=stops, progress=args.progress,
                       sampling=sampling, seed=seed)
    result = {**report.summary(), "max_new_tokens": limit, "data_temperature": data_temperature}
    if samples and args.max_turns is None:
        result.update(eval_walk(drafter, target, samples, device, limit=limit, stops=stops, sampling=sampling))
    if args.engine == "vllm":
        from dflash.serving.vllm import serve_check

        result["served"] = serve_check(spec, drafter_dir, prompts, report, max_new_tokens=limit, stop_ids=stops,
                                       dtype=str(dtype).removeprefix("torch."), seed=seed)
    if args.json:
        print(json.dumps(result, indent=2), file=out)
    else:
        describe(result, limit=limit,
                 where=f"{drafter_dir} on {target_path} ({device.type}, {str(dtype).removeprefix('torch.')})")
        if "served" in result:
            from dflash.serving.vllm import describe as describe_served

            describe_served(result["served"], result["served"]["engine"])
    if result["lossless"] is False or result.get("served", {}).get("vllm_mismatched_turns"):
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
