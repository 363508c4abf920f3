"""The DFlash mask token: the token the drafter's block slots hold, embedded with the target's
frozen embedding. It belongs to the tokenizer, not to any data: a token store's tokenizer
fingerprint leaves it out."""
from __future__ import annotations

MASK_TOKEN = "<|MASK|>"

def ensure_mask_token(tokenizer, num_embedding_rows: int, token: str = MASK_TOKEN) -> int:
    """Add the DFlash mask token to the tokenizer if missing and return its id.

    The mask token is embedded with the target's frozen embedding, so its id must be one of the
    target's embedding rows. Qwen3 pads its table (151936 rows for 151669 tokens), so the new
    token takes a spare row. When the table has no spare row, this raises: either resize the
    target's embeddings (`model.resize_token_embeddings(len(tokenizer))`, and serve that
    resized target) or reuse an existing unused token as the mask (pass its text as `token`).
    """
    if token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [token]})
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not 0 <= token_id < num_embedding_rows:
        raise ValueError(
            f"mask token {token!r} got id {token_id}, but the target's embedding has only "
            f"{num_embedding_rows} rows (no spare padded row). Choose one: resize the target's "
            f"embeddings to len(tokenizer) and serve that resized target, or reuse an existing unused "
            f"token of the vocabulary as the mask token (ensure_mask_token(tokenizer, rows, token=...))."
        )
    return token_id
