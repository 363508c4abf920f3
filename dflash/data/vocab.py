"""The DFlash mask token: the token the drafter's block slots hold, embedded with the target's
frozen embedding. It belongs to the tokenizer, not to any data: a token store's tokenizer
fingerprint leaves it out."""
from __future__ import annotations

MASK_TOKEN = "<|MASK|>"


def check_mask_token(tokenizer, num_embedding_rows: int, token: str = MASK_TOKEN) -> None:
    """Raise ValueError, saying what to do, when `token` does not have, or would not get, one of the
    target's embedding rows. Reads the tokenizer only: callable before the target's weights load."""
    vocab = tokenizer.get_vocab()
    token_id = vocab[token] if token in vocab else len(tokenizer)  # an added token takes the next id
    if 0 <= token_id < num_embedding_rows:
        return
    unused = _unused_special_tokens(tokenizer, num_embedding_rows)
    raise ValueError(
        f"the mask token {token!r} would get id {token_id}, but the target's embedding has {num_embedding_rows} "
        f"rows and the tokenizer {len(tokenizer)} tokens: no row is spare. Either reuse a token your data never "
        f"use as the mask: train.py --mask-token TEXT"
        + (f" (this tokenizer's special tokens that its chat template does not use: {', '.join(unused)})"
           if unused else "")
        + f"; or give the target a spare row: load it with transformers, model.resize_token_embeddings("
        f"{len(tokenizer) + 1}), save_pretrained it and its tokenizer into a new folder, and train (and serve) "
        "that one")


def _unused_special_tokens(tokenizer, num_embedding_rows: int, limit: int = 3) -> list[str]:
    """Special tokens of the tokenizer with an embedding row that its chat template and
    eos/bos/pad/unk do not use (e.g. Llama 3's reserved ones): candidates for --mask-token, the
    last-added first."""
    used = {tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = [t.content for i, t in sorted(added.items(), reverse=True)
             if i < num_embedding_rows and getattr(t, "special", False) and t.content not in used
             and t.content not in template]
    return [repr(t) for t in found[:limit]]


def ensure_mask_token(tokenizer, num_embedding_rows: int, token: str = MASK_TOKEN) -> int:
    """Add the DFlash mask token to the tokenizer if missing and return its id.

    The mask token is embedded with the target's frozen embedding, so its id must be one of the
    target's embedding rows. Qwen3 pads its table (151936 rows for 151669 tokens), so the new
    token takes a spare row. When the table has no spare row, this raises (`check_mask_token`)
    and leaves the tokenizer as it was.
    """
    check_mask_token(tokenizer, num_embedding_rows, token)
    if token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [token]})
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not 0 <= token_id < num_embedding_rows:  # a tokenizer that numbers added tokens otherwise
        raise ValueError(f"the mask token {token!r} got id {token_id}, outside the target's {num_embedding_rows} "
                         "embedding rows; give an existing token with train.py --mask-token TEXT")
    return token_id
