"""Capture the target's tapped features of a data set once, for many training runs (`dflash.features`).

    python launch/capture_features.py --target MODEL --data DATA --output DIR
    deepspeed launch/train.py --target MODEL --data DIR/tokens --features DIR ...

--data is a token store, or conversations (any format launch/train.py takes) tokenized here with the
target's tokenizer into DIR/tokens (reused while the same). The run that reads the features gives
the same --target and that token store as --data, and taps the same layers; anything else is
refused in one line. Disk: (K + 1) x hidden x bytes per token (printed). --engine vllm: vLLM's
offline engine runs the target (the `serve` extra) and writes the same store, of the states it
serves with (equal to the transformers capture's to fp32 rounding on the CPU).

One capture writes DIR at a time (a second one stops at once); DIR is marked as a capture's
(.dflash_writer.json), a capture again replaces only the store's own files, and a folder holding
files of others under those names is refused. DIR is never --data or --target, nor in or around them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dflash.errors import UserError, exit_on_user_error
from dflash.options import number


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target: a model folder, a Hub id or a .gguf file")
    p.add_argument("--data", required=True, help="a token store, or conversations to tokenize into DIR/tokens")
    p.add_argument("--output", required=True, type=Path, help="the feature store folder (DIR)")
    p.add_argument("--target-layer-ids", default="",
                   help="tapped layers, comma-separated (default: the official rule with --num-target-features)")
    p.add_argument("--num-target-features", type=number(int, minimum=1), default=5,
                   help="taps when --target-layer-ids is not given (default: 5)")
    p.add_argument("--max-length", type=number(int, minimum=1), default=None,
                   help="when --data is conversations: truncate samples to this many tokens (default: none)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the target's dtype (auto: bf16 on a GPU, fp32 on the CPU); the run reading the features "
                        "trains in the same")
    p.add_argument("--token-budget", type=number(int, minimum=1), default=16384,
                   help="tokens per captured micro-batch (default: 16384)")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                   help="what runs the target: transformers (default), or vLLM's offline engine (bash "
                        "launch/install.sh serve), the states it serves with; the same store")
    return p.parse_args(argv)


WRITER = "launch/capture_features.py"  # the feature store's mark


def store_entry(name: str) -> bool:
    """Whether a capture writes an entry of this name in its --output."""
    from dflash.features import META

    return name in (META, "features.bin", "states.bin", "offsets.npy", "shared.safetensors", "tokens")


def capture_with_vllm(spec, store, out, *, target_layer_ids, dtype, token_budget: int = 16384,
                      progress: bool = True) -> dict:
    """`dflash.features.capture` with the features computed by vLLM: the same store of `store` (a
    TokenStore) for the target of `spec`, tapped at `target_layer_ids`, in `dtype` (a torch dtype). Returns
    the meta. Here, not in `dflash.serving`: the store's writer is of a room above it."""
    import torch
    import vllm

    from dflash.features import write_store
    from dflash.serving.vllm import engine_folder
    from dflash.serving.vllm_features import FeatureEngine

    if not spec.gguf_file:
        from dflash.folders import check_target_folder

        check_target_folder(spec.folder)  # config.json there, each weight file whole: one line, not vLLM's trace
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    engine = FeatureEngine(engine_folder(spec), target_layer_ids, spec.num_layers,
                           max_model_len=int(max(store.lengths, default=1)) + 1, dtype=names[dtype])
    with engine:
        def features_of(samples: list[int]):
            return engine.features([store[i][0] for i in samples])

        # the config as transformers loads it in this dtype (the Hugging Face capture's meta)
        config = spec.config.to_dict() | {"dtype": names[dtype]}
        return write_store(out, spec, store, features_of, taps=list(target_layer_ids),
                           shared=engine.shared_weights(spec.embedding_rows), config=config,
                           engine=f"vllm {vllm.__version__}", token_budget=token_budget, progress=progress)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    try:
        taps = [int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    except ValueError:
        raise UserError(f"--target-layer-ids: comma-separated integers, got {args.target_layer_ids!r}") from None
    if args.output.exists() and not args.output.is_dir():
        raise UserError(f"--output {args.output}: not a folder")
    from dflash.partial import OutputLock, check_apart

    check_apart(args.output, {"--data": args.data, "--target": args.target if Path(args.target).exists() else None},
                "--output")
    # one capture per store, from the first check to the meta written last: a second one stops at once
    with OutputLock(args.output, what="capture"):
        capture_into(args, taps)


def capture_into(args, taps):
    """`main`'s work, under the store's lock: the store's folder marked as a capture's first (a
    folder of others' files under a store's names is refused), then the target loaded and run."""
    from dflash.data.sources import is_token_store
    from dflash.partial import check_own_folder, mark_folder
    from dflash.target.spec import load_target_spec

    check_own_folder(args.output, writer=WRITER, owned=store_entry, flag="--output")
    spec = load_target_spec(args.target)  # one line for a bad --target, before anything loads
    if spec.random:
        raise UserError(f"--target {args.target}: a random target's features are made in memory; nothing to capture")
    layer_ids = spec.layer_ids(taps, args.num_target_features)  # the taps its config allows, before the weights load
    if args.engine == "vllm":
        from dflash.serving.vllm import importlib_missing

        if importlib_missing("vllm"):
            raise UserError("--engine vllm: vLLM is not installed (bash launch/install.sh serve)")
    import torch

    from dflash.data.prepare import ensure_store
    from dflash.data.token_store import TokenStore
    from dflash.data.tokenizing import load_tokenizer
    from dflash.devices import resolve_dtype
    from dflash.features import capture
    from dflash.training.target import load_target

    # the data tokenized (or the store checked) with the target's tokenizer before its weights load:
    # a bad line is named now, not after the load
    tokenizer = load_tokenizer(spec.folder / spec.gguf_file if spec.gguf_file else spec.folder, "--target")
    args.output.mkdir(parents=True, exist_ok=True)
    mark_folder(args.output, WRITER)
    data = Path(args.data)
    if is_token_store(data):
        store_dir = data
        TokenStore(data).check_tokenizer(tokenizer, f"--target {args.target}")
    else:
        store_dir = args.output / "tokens"
        ensure_store(data, tokenizer, store_dir, max_length=args.max_length)
    store = TokenStore(store_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.engine == "vllm":
        meta = capture_with_vllm(spec, store, args.output, target_layer_ids=layer_ids,
                            dtype=resolve_dtype(args.dtype, device), token_budget=args.token_budget)
    else:
        target = load_target(spec, device, resolve_dtype(args.dtype, device), target_layer_ids=taps,
                             num_features=args.num_target_features, mask_token=False)
        meta = capture(target, spec, store, args.output, token_budget=args.token_budget)
    size = meta["tokens"] * meta["bytes_per_token"]
    print(f"captured {meta['tokens']:,} tokens of {meta['samples']:,} samples at layers {meta['target_layer_ids']} "
          f"({meta['dtype']}): {meta['bytes_per_token']:,} bytes per token, {size / 2**30:.2f} GiB in {args.output}")
    print(f"train from them: deepspeed launch/train.py --target {args.target} --data {store_dir} "
          f"--features {args.output}")


if __name__ == "__main__":
    main()
