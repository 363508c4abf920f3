#!/usr/bin/env python
"""Speculative decoding with a trained DFlash drafter: acceptance length, speed, and proof it is lossless.

  python launch/speculate.py [--drafter DIR] [--prompts F.jsonl] [--target DIR] [--json]

Every prompt is decoded greedily twice, by the target alone and by target + drafter (blocks of the
drafter's block size, KV caches for both, the verified tokens' target features fed back as the
drafter's context). Reported: the acceptance length (target tokens per target forward after the
prefill), tokens/s of both, the speedup, and whether every output is identical (it must be).

Without --prompts the turns are the held-out assistant turns of the run the drafter came from
(DIR/../config.json and its token store, the same split as the run's evaluation), and the walk
tau of the evaluation is computed on them too: on regenerated data the two agree. With no
arguments at all: the demo target, runs/demo/drafter and the demo's held-out turns.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash.errors import UserError, exit_on_user_error


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="runs/demo/drafter",
                   help="exported drafter folder (default: runs/demo/drafter)")
    p.add_argument("--prompts", help="JSONL conversations (`messages`): every assistant turn is decoded with the "
                   "file's history, and a conversation ending with a user turn gets one response (default: the "
                   "held-out turns of the drafter's run)")
    p.add_argument("--target", help="Hugging Face target folder (default: the run's target, else the demo target)")
    p.add_argument("--max-new-tokens", type=int, help="limit per turn (default: the limit the data was regenerated "
                   "with, meta.max_new_tokens, else 2048)")
    p.add_argument("--max-turns", type=int, help="decode only the first N turns")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p.parse_args(argv)


def run_heldout(drafter_dir: Path):
    """(target path, tokenized held-out samples, their turn limit) of the run the drafter came from:
    its store and split, found as the run found them."""
    from dflash.data.token_store import TokenStore
    from dflash.demo import DATA, TARGET
    from dflash.training.data import held_out_split, store_path, turn_limit

    run = drafter_dir.parent
    config_path = run / "config.json"
    if not config_path.is_file():
        raise UserError(f"--drafter {drafter_dir}: no run config {config_path} to find its held-out turns; "
                        "give --prompts")
    cfg = json.loads(config_path.read_text())
    data = Path(cfg.get("data") or DATA)
    store = TokenStore(store_path(data, run))
    _, eval_idx = held_out_split(len(store), cfg["eval_fraction"], cfg["seed"])
    if eval_idx.size == 0:
        raise UserError(f"{config_path}: the run held nothing out (eval_fraction 0); give --prompts")
    return Path(cfg.get("target") or TARGET), [store[int(i)] for i in eval_idx], turn_limit(store, data)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    import torch

    from dflash.data.generation import generation_eos, regeneration_limit, stop_ids
    from dflash.demo import TARGET
    from dflash.devices import resolve_dtype
    from dflash.models import DFlashDrafter
    from dflash.models.acceptance import walk_samples
    from dflash.models.speculate import (
        DEFAULT_MAX_NEW_TOKENS,
        prompts_from_conversations,
        prompts_from_samples,
        speculate,
    )
    from dflash.training.models import load_target

    drafter_dir = Path(args.drafter)
    if not (drafter_dir / "config.json").is_file():
        hint = " (train the demo first: deepspeed launch/train.py)" if args.drafter == "runs/demo/drafter" else ""
        raise UserError(f"--drafter {drafter_dir}: no exported drafter there (config.json){hint}")
    samples = None
    if args.prompts:
        if not Path(args.prompts).is_file():
            raise UserError(f"--prompts {args.prompts}: no such file")
        target_path = Path(args.target or TARGET)
        data_limit = regeneration_limit(args.prompts)
    else:
        target_path, samples, data_limit = run_heldout(drafter_dir)
        target_path = Path(args.target or target_path)
    limit = args.max_new_tokens or data_limit or DEFAULT_MAX_NEW_TOKENS
    if limit < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {limit}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, device)
    try:
        drafter = DFlashDrafter.from_pretrained(drafter_dir)
        target = load_target(target_path, device, dtype, target_layer_ids=drafter.config.target_layer_ids,
                             mask_token=False)
        drafter.attach(target.model.shared_weights())
    except ValueError as e:
        raise UserError(f"--drafter {drafter_dir} with --target {target_path}: {e}") from None
    drafter.to(device, dtype).eval()
    tokenizer, hf = target.tokenizer, target.hf
    stops = stop_ids(tokenizer, generation_eos(str(target_path)))
    prompts = prompts_from_conversations(args.prompts, tokenizer) if samples is None else prompts_from_samples(samples)
    prompts = prompts[:args.max_turns]
    if not prompts:
        raise UserError("no turns to decode")
    report = speculate(hf, drafter, prompts, max_new_tokens=limit, stop_ids=stops, progress=args.progress)
    result = {**report.summary(), "max_new_tokens": limit}
    if samples is not None and args.max_turns is None:
        walk = walk_samples(lambda b, f, a: drafter(b, f, anchors=a), lambda b: target.model.features(b.to(device)),
                            samples, block_size=drafter.block_size, max_turn_tokens=limit, stop_ids=stops).metrics()
        result.update(walk_tau=walk["tau"], anchor_tau=walk["anchor_tau"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['turns']} turns, {result['tokens']:,} tokens (at most {limit} per turn), "
              f"{drafter_dir} on {target_path} ({device.type}, {str(dtype).removeprefix('torch.')})")
        print(f"acceptance length {result['acceptance_length']:.3f} target tokens per target forward")
        if "walk_tau" in result:
            print(f"eval on the same turns: walk tau {result['walk_tau']:.3f}, anchor tau {result['anchor_tau']:.3f}")
        print(f"target alone {result['target_tokens_per_s']:.1f} tokens/s, speculative "
              f"{result['speculative_tokens_per_s']:.1f} tokens/s, speedup {result['speedup']:.2f}x")
        print("lossless: every output equals the target's greedy output" if result["lossless"] else
              f"NOT LOSSLESS: turns {result['mismatched_turns']} differ from the target's greedy output")
    if not result["lossless"]:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
