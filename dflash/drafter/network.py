"""The DFlash drafter: Qwen3-style layers conditioned on target features by KV injection.

Per token of the micro-batch, the K tapped target states are fused once:
ctx = hidden_norm(fc(concat(taps))). Each block (anchor token, then B-1 mask tokens, embedded
with the target's frozen embedding) runs through N layers; in every layer the block's queries
attend to keys/values that are k_proj/v_proj of the context rows before the anchor (RoPE at
their in-sample positions j) and of the block's own B rows (RoPE at anchor + k): a full_attention
layer without a mask inside the block, a sliding_attention layer causal inside the block and
limited to the last `sliding_window` positions (as vLLM and SGLang serve it; `config.layer_types`).
Then the final norm and the target's frozen lm_head.

Training runs all blocks of a packed micro-batch at once through
`dflash.ops.dflash_block_attention`. The module owns only trainable parameters (fc, norms,
layers); its state_dict is exactly the official checkpoint's tensor set.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from dflash.data.batch import PackedBatch, PaddedBatch
from dflash.drafter.config import DrafterConfig
from dflash.drafter.kinds import architectures, drafter_kind
from dflash.errors import DiskFull, NonFiniteWeights, UserError, disk_full, free_space
from dflash.objective.anchors import Anchors, to_packed
from dflash.objective.blocks import Blocks
from dflash.target.model import SharedWeights

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, D), cos/sin (N, D)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class _Rope:
    """RoPE tables of the drafter config (default or scaled types, via transformers' init).

    Not a module: inv_freq stays float32 whatever dtype the drafter is cast to (a bf16
    inv_freq would shift every angle at long positions).
    """

    def __init__(self, config: DrafterConfig) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        hf = config.to_qwen3_config()
        rope_type = hf.rope_parameters.get("rope_type", "default")
        init = Qwen3RotaryEmbedding.compute_default_rope_parameters if rope_type == "default" else (
            ROPE_INIT_FUNCTIONS[rope_type]
        )
        inv_freq, self.scaling = init(hf)
        self._inv_freq = {torch.device("cpu"): inv_freq.float()}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = positions.device
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        freqs = positions.float()[:, None] * self._inv_freq[device][None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class LayerCache:
    """One drafter layer's keys (k_norm and RoPE applied) and values of the context rows seen so far."""

    def __init__(self, capacity: int, heads: int, head_dim: int, dtype, device) -> None:
        self.k = torch.empty(capacity, heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add rows; returns every row held (views)."""
        end = self.length + k.shape[0]
        if end > self.k.shape[0]:
            raise ValueError(f"drafter cache holds {self.k.shape[0]} context rows, {end} were given")
        self.k[self.length:end], self.v[self.length:end] = k, v
        self.length = end
        return self.k[:end], self.v[:end]


class DrafterCache:
    """The context rows of one sequence for decoding, one `LayerCache` per drafter layer."""

    def __init__(self, drafter: DFlashDrafter, capacity: int) -> None:
        c, w = drafter.config, drafter.fc.weight
        self.layers = [LayerCache(capacity, c.num_key_value_heads, c.head_dim, w.dtype, w.device)
                       for _ in drafter.layers]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


class DFlashAttention(nn.Module):
    def __init__(self, config: DrafterConfig, backend: str = "auto", layer_idx: int = 0) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        self.backend = backend
        # The mask this layer is served with (vLLM / SGLang): window and causality of its type.
        self.window, self.causal = config.layer_attention(layer_idx)
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)

    def forward(self, x, ctx, rope_blk, rope_ctx, seqlens, anchors: Anchors, cache: LayerCache | None = None):
        """x (NB*B, H) normed block states, ctx (T, H) fused context -> (NB*B, H).

        seqlens: (cu_seqlens on the device, its CPU copy) of the context rows the blocks see.
        cache: decoding: ctx holds only the new context rows; their keys and values are appended
        to the cache, and the blocks attend to all of the cache's rows (seqlens describe those).
        """
        from dflash.ops import dflash_block_attention

        D = self.head_dim
        q = _apply_rope(self.q_norm(self.q_proj(x).view(-1, self.num_heads, D)), *rope_blk)
        k_blk = _apply_rope(self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, D)), *rope_blk)
        v_blk = self.v_proj(x).view(-1, self.num_kv_heads, D)
        k_ctx = _apply_rope(self.k_norm(self.k_proj(ctx).view(-1, self.num_kv_heads, D)), *rope_ctx)
        v_ctx = self.v_proj(ctx).view(-1, self.num_kv_heads, D)
        if cache is not None:
            k_ctx, v_ctx = cache.append(k_ctx, v_ctx)
        cu_seqlens, cu_seqlens_cpu = seqlens
        out = dflash_block_attention(
            q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, anchors.block_seq, anchors.block_anchor, anchors.block_size,
            backend=self.backend, cu_seqlens_cpu=cu_seqlens_cpu, window=self.window, causal=self.causal,
        )
        return self.o_proj(out.reshape(x.shape[0], -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, backend: str = "auto", layer_idx: int = 0) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        super().__init__()
        self.self_attn = DFlashAttention(config, backend, layer_idx)
        self.mlp = Qwen3MLP(config.to_qwen3_config())
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, rope_blk, rope_ctx, seqlens, anchors, cache=None) -> torch.Tensor:
        # The context enters un-normed here: it was normed once by hidden_norm, as in the official model.
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, seqlens, anchors, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def is_drafter_folder(path: Path) -> bool:
    """An empty folder, or one holding the config of a drafter of a known kind (and nothing but its files)."""
    names = {p.name for p in path.iterdir()} if path.is_dir() else {None}
    if not names:
        return True
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return names <= {CONFIG_NAME, WEIGHTS_NAME} and config.get("architectures") in ([a] for a in architectures())


def drafter_class(config: DrafterConfig) -> type[DFlashDrafter]:
    """The drafter module a config builds: its kind's network."""
    return drafter_kind(config.kind).network


class DFlashDrafter(nn.Module):
    """DFlash drafter with the official checkpoint layout.

    Args:
        config: sizes (see `DrafterConfig.from_target`).
        shared: the target's frozen embedding and lm_head (`TargetModel.shared_weights()`);
            held by reference, never registered, never saved. Needed for forward only.
        attention_backend: `dflash.ops` backend ("auto": Triton on CUDA, torch elsewhere).

    Training call (the blocks drawn by the loader, `dflash.objective.blocks.draw_blocks`):
        hidden = drafter(batch, target.features(batch), blocks)
        out = BlockLoss()(hidden, blocks, drafter.lm_head)
        engine.backward(out.loss_sum / step_weight_total)
    """

    # a network whose `propose` chooses a block's drafts from its states (else each slot's own logits)
    chooses_drafts = False

    def __init__(
        self,
        config: DrafterConfig,
        shared: SharedWeights | None = None,
        *,
        attention_backend: str = "auto",
        activation_checkpointing: bool = False,
    ) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, attention_backend, i) for i in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        # recompute each layer in backward instead of keeping its activations: less memory, ~1/3 more compute
        self.activation_checkpointing = activation_checkpointing
        self._rope = _Rope(config)
        self._shared = None
        if shared is not None:
            self.attach(shared)
        self._init_weights()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def attach(self, shared: SharedWeights) -> None:
        """Lend the target's frozen embedding and lm_head (checked against the config)."""
        V, H = self.config.vocab_size, self.config.hidden_size
        for name, w in (("embed", shared.embed), ("lm_head", shared.lm_head)):
            if tuple(w.shape) != (V, H):
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, the drafter config expects {(V, H)}")
        self._shared = shared

    @property
    def lm_head(self) -> torch.Tensor:
        """The target's frozen lm_head weight (V, H), which every loss scores through."""
        return self._require_shared().lm_head

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.config.initializer_range)

    def _require_shared(self) -> SharedWeights:
        if self._shared is None:
            raise RuntimeError("the drafter needs the target's embedding and lm_head: "
                               "call attach(target.shared_weights())")
        return self._shared

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Fused context (T, H) from the concatenated target taps (T, K*H)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_hidden(
        self,
        features: torch.Tensor,
        block_input_ids: torch.Tensor,
        block_position_ids: torch.Tensor,
        ctx_position_ids: torch.Tensor,
        seqlens: tuple[torch.Tensor, torch.Tensor],
        anchors: Anchors,
        cache: DrafterCache | None = None,
    ) -> torch.Tensor:
        """Final-normed drafter states of all blocks, (NB*B, H); anchors on the device. The one
        forward of the drafter: training, the eval walk and speculative decoding all run it.

        seqlens: (cu_seqlens, cu_seqlens_cpu) of the context rows the blocks see.
        cache: decoding: `features` are only the new context rows (positions `ctx_position_ids`),
            appended to the cache; the blocks see every row of it.
        """
        shared = self._require_shared()
        dtype = self.fc.weight.dtype
        ctx = self.context(features)
        x = self.embed_blocks(F.embedding(block_input_ids, shared.embed).to(dtype))
        rope_blk = self._rope(block_position_ids, dtype)
        rope_ctx = self._rope(ctx_position_ids, dtype)
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layers[i]
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, ctx, rope_blk, rope_ctx, seqlens, anchors, layer_cache,
                                                      use_reentrant=False)
            else:
                x = layer(x, ctx, rope_blk, rope_ctx, seqlens, anchors, layer_cache)
        return self.norm(x)

    def embed_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The block tokens' embeddings (NB*B, H) as the layers take them (a kind may scale them)."""
        return x

    @torch.no_grad()
    def draft(self, cache: DrafterCache, features: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """Speculative decoding: append the target features of the next context positions
        (cache.length ..) to the cache, then draft the block anchored right after them, as training
        scores it. Returns the logits of slots 1..B-1, (B-1, V)."""
        return self.logits(self.draft_hidden(cache, features, anchor_token))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's logits (N, V) of final-normed states (N, H), through the target's lm_head."""
        lm_head = self.lm_head
        return hidden.to(lm_head.dtype) @ lm_head.t()

    @torch.no_grad()
    def draft_hidden(self, cache: DrafterCache, features: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """`draft`'s final-normed states of slots 1..B-1, (B-1, H)."""
        B, device = self.block_size, self.fc.weight.device
        start = cache.length + features.shape[0]
        ids = torch.full((B,), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0] = anchor_token
        cu = torch.tensor([0, start], dtype=torch.int32)
        anchors = Anchors(torch.zeros(1, dtype=torch.int32), torch.tensor([start], dtype=torch.int32), B, 0)
        hidden = self.block_hidden(features, ids, torch.arange(start, start + B, device=device),
                                   torch.arange(cache.length, start, device=device), (cu.to(device), cu),
                                   anchors.to(device), cache)
        return hidden[1:]

    def forward(self, batch: PackedBatch | PaddedBatch, features: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        """Training forward of one micro-batch: the final-normed states of its blocks, (NB*B, H), for a
        loss (`dflash.objective.loss.BlockLoss`).

        Args:
            batch: packed or padded micro-batch (a padded one is packed here; the features
                of `TargetModel.features` are already in packed order for both).
            features: (T, K*H) target taps of the batch's real tokens, packed order.
            blocks: the micro-batch's blocks (`dflash.objective.blocks`), on the batch's device.
        """
        packed = to_packed(batch)
        if features.shape[0] != packed.input_ids.shape[0]:
            raise ValueError(f"features cover {features.shape[0]} tokens, the batch has {packed.input_ids.shape[0]}")
        return self.block_hidden(features, blocks.input_ids, blocks.position_ids, packed.position_ids,
                                 (packed.cu_seqlens, packed.cu_seqlens_cpu), blocks.anchors)

    def save_pretrained(self, directory: str | os.PathLike, target: dict | None = None) -> None:
        """Write `config.json` and `model.safetensors` in the official DFlash format (`target`: the
        record of the target it was trained on, under `TARGET_KEY`, which the engines ignore).

        All or nothing: the files are written to a temporary folder beside `directory` and
        renamed into place. Non-finite weights are refused, and an existing `directory` is
        replaced only if it is empty or a DFlash drafter (what this writes).
        """
        import shutil

        from safetensors.torch import save_file

        from dflash.partial import file_mode, partial_folder

        directory = Path(directory)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.export_tensors().items()}
        bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise NonFiniteWeights(f"{directory}: not exported: {len(bad)} of {len(tensors)} weight tensors hold NaN "
                                   f"or inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
        if directory.exists() and not is_drafter_folder(directory):
            raise UserError(f"{directory}: exists and is not a drafter folder ({', '.join(architectures())}); "
                            "not replaced (move it away)")
        config = self.config.to_json_dict()
        config["dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        if target is not None:
            from dflash.drafter.config_format import TARGET_KEY

            config[TARGET_KEY] = target
        directory.parent.mkdir(parents=True, exist_ok=True)
        work = partial_folder(directory)
        try:
            staged = work / "drafter"
            staged.mkdir()
            with open(staged / CONFIG_NAME, "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
                f.write("\n")
            save_file(tensors, staged / WEIGHTS_NAME, metadata={"format": "pt"})
            os.chmod(staged / WEIGHTS_NAME, file_mode())  # safetensors writes 0600: readable as the umask says
            if directory.exists():
                os.replace(directory, work / "old")  # removed below, once the new one is in place
            os.replace(staged, directory)
        except Exception as err:  # noqa: BLE001 - safetensors reports a full disk as a SafetensorError
            if not disk_full(err):
                raise
            raise DiskFull(f"{directory}: not exported: the disk is full ({free_space(directory.parent)}); "
                            "nothing was written" + (" and the previous export is unchanged" if directory.exists()
                                                     else "")) from None
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the checkpoint by their released names (the state_dict's here)."""
        return self.state_dict()

    @staticmethod
    def checkpoint_names(tensors: dict) -> dict:
        """A checkpoint's tensors (or shapes) by state_dict name: a uniform `model.` prefix removed."""
        if tensors and all(k.startswith("model.") for k in tensors):
            tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        return tensors

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike, shared: SharedWeights | None = None, **kwargs
    ) -> DFlashDrafter:
        """Load a checkpoint in the official format (ours or written by others), as the network of the
        drafter kind its architecture names.

        Weights keep the stored dtype. A uniform `model.` prefix on the tensor names is
        accepted; any missing or unknown tensor is an error (serving engines would silently
        skip it). kwargs go to the constructor (attention_backend, activation_checkpointing).
        """
        from safetensors.torch import load_file

        with open(os.path.join(directory, CONFIG_NAME)) as f:
            config = DrafterConfig.from_json_dict(json.load(f))
        cls = drafter_class(config) if cls is DFlashDrafter else cls
        tensors = cls.checkpoint_names(load_file(os.path.join(directory, WEIGHTS_NAME)))
        model = cls(config, shared, **kwargs)
        expected = set(model.state_dict())
        missing, unknown = expected - set(tensors), set(tensors) - expected
        if missing or unknown:
            raise ValueError(
                f"checkpoint {directory} does not match the {cls.__name__}: missing {sorted(missing)}, "
                f"unknown {sorted(unknown)}"
            )
        dtypes = {v.dtype for v in tensors.values()}
        if len(dtypes) == 1:
            model.to(dtypes.pop())
        model.load_state_dict(tensors, strict=True)
        return model
