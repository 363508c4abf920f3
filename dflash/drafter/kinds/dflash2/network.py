"""The DFlash2 drafter: a DFlash drafter with grouped dynamic causal convolutions around each
sublayer, unary logits softcap(output_multiplier x lm_head(h)), and a candidate selector.

Convolution (per layer, one before and one after the attention, the same around the MLP): from the
sublayer's normed input x, a projection gives per position t two sets of dynamic weights
delta[i, t, g] (tap i < conv_kernel_size, channel group g of conv_group_size channels); the conv
before the sublayer maps x to y[t, c] = sum_i (base[0, i, c] + delta0[i, t, g(c)]) x[t - i, c], the
one after it maps the sublayer's output z the same way with base[1] and delta1 (still computed from
x). Taps never cross the block boundary: slot k sees slots k-1 .. k-K+1 of its own block, as decoding
runs one block at a time. In the packed training layout (rows [j*B, (j+1)*B) = block j) that is a
convolution within each group of B rows.

Selector (decoding, `CandidateSelector.select`): per drafted slot the top-`selector_top_k` unary
logits are the candidates; the transition score of candidate c after token p at a slot with state h
is unary[c] + <A[p] * P h, B[c]> (A, B: the predecessor and successor codebooks, P: the hidden
projection, all of rank `selector_rank`); greedy walks the best candidate from the verified anchor,
slot by slot; at T > 0 it samples q = softmax(score / T) over the K candidates instead and returns q.

Training (`SelectorTerm`, a term of the loss room): K-way cross-entropy of the same scores with the
data's tokens as predecessors (teacher forcing), the gold token put in place of the last candidate
where the top-K misses it. The unary scores come detached from the chunked lm_head pass (the DFlash
cross-entropy trains them); the selector's gradient reaches the backbone through P h, unless
`stop_grad`.

Initialisation: the convolutions start as the identity (base tap 0 = 1, other taps and the
projection 0) and the hidden projection at 0 (every transition scores 0: the selector picks the
unary argmax), so a DFlash2 drafter starts as the DFlash drafter of the same seed computes.

The checkpoint is the release's (z-lab/dflash `DFlash2DraftModel`): `layers.i.{attention,mlp}_conv.
{base_kernel [2, K, H], kernel_projection.weight [2*K*H/G, H]}`, `candidate_selector.
{hidden_projection.weight [R, H], predecessor_codebook [V, R], successor_codebook [V, R]}` (the
codebooks without `.weight`, as released; either name loads).
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from dflash.drafter.config import DrafterConfig
from dflash.drafter.network import DFlashDecoderLayer, DFlashDrafter
from dflash.objective.blocks import Blocks
from dflash.objective.loss import Finished, LogitTerm
from dflash.target.model import SharedWeights

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def block_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int,
               group_size: int) -> torch.Tensor:
    """x (NB*B, H) block-major, dynamic (NB*B, K, H/G), base (K, H) -> (NB*B, H):
    out[t, c] = sum_i (base[i, c] + dynamic[t, i, c // G]) x[t - i, c], zero where t - i leaves t's block.
    One op (`dflash.ops.block_conv`: Triton on CUDA, else the reference recomputed in backward), which keeps
    only x and the weights for backward."""
    from dflash.ops.block_conv import block_conv as conv

    return conv(x, dynamic, base, block_size, group_size)


class RecomputedConvOutputs(torch.autograd.graph.saved_tensors_hooks):
    """While active (a DFlash2 drafter's training forward), a tensor a convolution before a sublayer made
    (registered by `GroupedDynamicCausalConv`) is saved for backward as its recipe, the convolution's
    inputs, which the op and the kernel projection keep anyway, and remade once when the backward first
    needs it: the sublayer's projections then keep no copy of their input."""

    def __init__(self):
        self.made: dict[int, tuple] = {}
        super().__init__(self._pack, self._unpack)

    def register(self, out: torch.Tensor, *recipe) -> None:
        self.made[id(out)] = (weakref.ref(out), recipe)

    def _pack(self, t):
        entry = self.made.get(id(t))
        if entry is None or entry[0]() is not t:
            return t
        return _Recipe(entry[1], t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def _unpack(packed):
        return packed.remake() if isinstance(packed, _Recipe) else packed

    def __exit__(self, *exc):
        self.made.clear()
        return super().__exit__(*exc)


class _Recipe:
    """A saved convolution output: its inputs, and the output once remade (shared by the projections)."""

    def __init__(self, recipe: tuple, size, stride, offset):
        self.recipe, self.geometry, self.out = recipe, (size, stride, offset), None

    def remake(self) -> torch.Tensor:
        if self.out is None:
            with torch.no_grad():
                self.out = block_conv(*self.recipe)
        return self.out.as_strided(*self.geometry)


_ACTIVE: list[RecomputedConvOutputs] = []  # the context of the running forward, if any


class GroupedDynamicCausalConv(nn.Module):
    """The two convolutions around one sublayer; both run through `forward` (ZeRO-3 gathers
    `base_kernel` for module forwards only)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def forward(self, x: torch.Tensor, block_size: int, dynamic: torch.Tensor | None = None):
        """Before the sublayer (dynamic None): x (NB*B, H) normed input -> (its convolution, the dynamic
        weights of the convolution after it). After (dynamic given): the sublayer's output -> its convolution."""
        if dynamic is not None:
            return block_conv(x, dynamic, self.base_kernel[1], block_size, self.group_size)
        dyn = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, -1)
        recipe = (x, dyn[:, 0], self.base_kernel[0], block_size, self.group_size)
        out = block_conv(*recipe)
        if _ACTIVE and torch.is_grad_enabled():
            _ACTIVE[-1].register(out, *recipe)
        return out, dyn[:, 1]

    def finish(self, z: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
        return self(z, block_size, dynamic)


class ConvDecoderLayer(nn.Module):
    """A DFlash decoder layer's modules (taken over, as built and initialised) with a convolution pair
    around each sublayer."""

    def __init__(self, layer: DFlashDecoderLayer, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.attention_conv = GroupedDynamicCausalConv(hidden_size, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicCausalConv(hidden_size, kernel_size, group_size)

    def forward(self, x, ctx, rope_blk, rope_ctx, seqlens, anchors, cache=None) -> torch.Tensor:
        B = anchors.block_size
        h, kernel = self.attention_conv(self.input_layernorm(x), B)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, rope_blk, rope_ctx, seqlens, anchors, cache),
                                           kernel, B)
        h, kernel = self.mlp_conv(self.post_attention_layernorm(x), B)
        return x + self.mlp_conv.finish(self.mlp(h), kernel, B)


class CandidateSelector(nn.Module):
    """Transition scores <A[prev] * P h, B[cand]> over low-rank codebooks (see the module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)  # every transition scores 0: the unary argmax

    def forward(self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """hidden (N, H), predecessors (N,), candidates (N, K) token ids -> (N, K) float32 transition scores."""
        query = self.predecessor_codebook(predecessors) * self.hidden_projection(hidden.to(
            self.hidden_projection.weight.dtype))
        return torch.einsum("nr,nkr->nk", query, self.successor_codebook(candidates)).float()

    @torch.no_grad()
    def select(self, hidden: torch.Tensor, unary: torch.Tensor, anchor: int, temperature: float = 0.0,
               generator: torch.Generator | None = None):
        """Decoding: hidden (B-1, H) states of slots 1..B-1, unary (B-1, V) their logits, `anchor` the
        verified token -> (tokens (B-1,), candidates (B-1, K), q (B-1, K) over them at T > 0, else None)."""
        values, candidates = unary.float().topk(self.top_k, dim=-1)
        prev = torch.tensor([anchor], device=hidden.device)
        path, qs = [], []
        for p in range(hidden.shape[0]):
            scores = values[p] + self(hidden[p:p + 1], prev, candidates[p:p + 1])[0]
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[0]
                qs.append(q)
            else:
                index = scores.argmax()
            prev = candidates[p, index].view(1)
            path.append(prev)
        return torch.cat(path), candidates, torch.stack(qs) if qs else None


def unary_logits(raw: torch.Tensor, config: DrafterConfig) -> torch.Tensor:
    """softcap(output_multiplier x raw): the logits a DFlash2 drafter drafts and selects from."""
    s = config.kind_settings
    logits = raw.float() * s.output_multiplier
    if s.final_logit_softcapping is not None:
        logits = torch.tanh(logits / s.final_logit_softcapping) * s.final_logit_softcapping
    return logits


class DFlash2Drafter(DFlashDrafter):
    """The DFlash2 drafter (a config of kind dflash2): the DFlash drafter's modules, built and initialised
    first exactly as a DFlash drafter's, then the convolutions and the selector. Same forward
    (`forward(batch, features, blocks) -> hidden states`), so training, the eval walk and decoding share it."""

    # Under --optimizer muon these stay on AdamW (`ds_config.muon_split`): the codebooks are lookup tables
    # (as embeddings are), the base kernels (2, K, H) no matrices.
    adamw_parameters = ("candidate_selector.*_codebook.weight", "*.base_kernel")
    chooses_drafts = True  # the selector's path (`propose`)

    def __init__(self, config: DrafterConfig, shared: SharedWeights | None = None, **kwargs) -> None:
        if config.kind_settings is None:
            raise ValueError("a DFlash2 drafter needs its settings (DrafterConfig.kind_settings)")
        super().__init__(config, shared, **kwargs)
        s, H = config.kind_settings, config.hidden_size
        for i, layer in enumerate(self.layers):
            self.layers[i] = ConvDecoderLayer(layer, H, s.conv_kernel_size, s.conv_group_size)
        self.candidate_selector = CandidateSelector(H, config.vocab_size, s.selector_rank, s.selector_top_k)

    def block_hidden(self, *args, **kwargs) -> torch.Tensor:
        """`DFlashDrafter.block_hidden`, the outputs of the convolutions before the sublayers remade in
        backward (`RecomputedConvOutputs`) unless the layers are checkpointed (they keep only their inputs)."""
        if not torch.is_grad_enabled() or self.activation_checkpointing:
            return super().block_hidden(*args, **kwargs)
        hooks = RecomputedConvOutputs()
        with hooks:
            _ACTIVE.append(hooks)
            try:
                return super().block_hidden(*args, **kwargs)
            finally:
                _ACTIVE.pop()
    def embed_blocks(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.config.kind_settings.input_embedding_scale
        return x if scale == 1.0 else x * scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unary logits (N, V) float32 of final-normed states (N, H)."""
        return unary_logits(super().logits(hidden), self.config)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor: int, temperature: float = 0.0,
                generator: torch.Generator | None = None):
        """The selector's path over slots 1..B-1 of one drafted block (`CandidateSelector.select`)."""
        return self.candidate_selector.select(hidden, self.logits(hidden), anchor, temperature, generator)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The state_dict with the codebooks by their released names (no `.weight`)."""
        names = {f"candidate_selector.{c}.weight": f"candidate_selector.{c}" for c in CODEBOOKS}
        return {names.get(k, k): v for k, v in self.state_dict().items()}

    @staticmethod
    def checkpoint_names(tensors: dict) -> dict:
        """Both codebook names load: the released (no `.weight`) and the state_dict's."""
        tensors = DFlashDrafter.checkpoint_names(tensors)
        released = {f"candidate_selector.{c}": f"candidate_selector.{c}.weight" for c in CODEBOOKS}
        return {released.get(k, k): v for k, v in tensors.items()}


def selector_figures(sums: dict, blocks: float) -> dict:
    """The selector's figures from `LossOutput.metrics` summed over `blocks` blocks (micro-batches and ranks
    added as sums): candidate recall (the gold token among the unary top-K) and selector accuracy (its
    teacher-forced choice is the gold token) over the scored rows, and `argmax_anchor_tau`, the acceptance
    the backbone's own argmax reaches on the same blocks (`anchor_tau` is the selector path's)."""
    rows = max(float(sums["selector_rows"]), 1.0)
    return {"selector_recall": float(sums["selector_recall"]) / rows,
            "selector_accuracy": float(sums["selector_correct"]) / rows,
            "argmax_anchor_tau": float(sums["argmax_tau_sum"]) / blocks if blocks else 0.0}


class SelectorTerm(LogitTerm):
    """The selector's objective in the loss room: K-way cross-entropy of the transition scores over the
    unary top-K (taken from each chunk of the lm_head pass; no rows x vocab buffer), predecessors the
    data's tokens, the gold token in place of the last candidate where the top-K misses it; weighted
    per row as the DFlash cross-entropy (so `weight` sets it against that loss).

    Metrics (`LossOutput.metrics`, sums over scored rows): selector_rows, selector_recall (gold among
    the unary top-K), selector_correct (the teacher-forced selector picks the gold token among them).
    """

    name = "selector"
    vocab_buffers = 0
    metric_names = ("selector_rows", "selector_recall", "selector_correct")

    def __init__(self, selector: CandidateSelector, weight: float = 1.0, stop_grad: bool = False):
        super().__init__(weight)
        self.selector, self.stop_grad = selector, stop_grad

    @property
    def head_top_k(self) -> int:
        return self.selector.top_k
    def figures(self, sums: dict, blocks: float) -> dict:
        return selector_figures(sums, blocks)

    def words(self, record: dict) -> str:
        if "argmax_tau" not in record:
            return ""
        return (f", the backbone's argmax alone tau {record['argmax_tau']:.3f}, selector recall "
                f"{record['selector_recall']:.3f}, accuracy {record['selector_accuracy']:.3f}")

    def start(self, blocks: Blocks, context: dict) -> None:
        rows, K = blocks.labels.numel(), self.selector.top_k
        device = blocks.labels.device
        self._labels = blocks.labels.reshape(-1)
        # rows the fused head skips (weight 0) keep finite stand-ins: their loss is weighted 0
        self._unary = torch.zeros(rows, K, dtype=torch.float32, device=device)
        self._candidates = torch.arange(K, device=device).expand(rows, K).clone()
        self._gold = torch.zeros(rows, dtype=torch.float32, device=device)

    def head_chunk(self, stats, rows):
        self._unary[rows], self._candidates[rows], self._gold[rows] = stats.top_values, stats.top_ids, stats.gold

    def chunk(self, logits, lo, hi, need_grad):
        self._unary[lo:hi], self._candidates[lo:hi] = logits.topk(self.selector.top_k, dim=-1)
        self._gold[lo:hi] = logits.gather(1, self._labels[lo:hi, None]).squeeze(1)
        return logits.new_zeros(()), None

    def finish(self, hidden, blocks, temperatures):
        B, K = blocks.block_size, self.selector.top_k
        gold = self._labels
        anchors = blocks.input_ids.view(-1, B)[:, :1]
        prev = torch.cat([anchors, blocks.labels[:, :-1]], dim=1).reshape(-1)  # teacher forcing
        hit = self._candidates == gold[:, None]
        found = hit.any(dim=1)
        # the gold token replaces the lowest candidate where the top-K misses it (the loss's set only)
        injected = torch.cat([self._candidates[:, :-1], gold[:, None]], 1)
        candidates = torch.where(found[:, None], self._candidates, injected)
        unary = torch.where(found[:, None], self._unary, torch.cat([self._unary[:, :-1], self._gold[:, None]], 1))
        target = torch.where(found, hit.float().argmax(dim=1), K - 1)
        scores = unary + self.selector(hidden.detach() if self.stop_grad else hidden, prev, candidates)
        ce = torch.logsumexp(scores, dim=1) - scores.gather(1, target[:, None]).squeeze(1)
        w = blocks.weights.reshape(-1).float()
        scored = blocks.valid.reshape(-1)
        correct = found & (scores.argmax(dim=1) == target)
        metrics = {"selector_rows": scored.sum().float(), "selector_recall": (found & scored).sum().float(),
                   "selector_correct": (correct & scored).sum().float()}
        # the eval walk follows the selector's path: where the drafts before a slot are the labels, its
        # draft is the label when the selector picks it, and q_t(label) is its softmax over the K candidates
        scores = scores.detach()
        logq = torch.stack([torch.log_softmax(scores / t, dim=1).gather(1, target[:, None]).squeeze(1)
                            for t in temperatures], dim=1) if temperatures else None
        if logq is not None:
            logq = logq.masked_fill(~found[:, None], float("-inf"))
        return Finished((ce * w).sum(), {k: v.detach() for k, v in metrics.items()}, correct, logq)
