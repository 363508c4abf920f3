"""The LiLiCorr drafter: a DFlash drafter whose drafts are a path through the lattice of its top-K
candidates per slot, scored by a small correlator (NVIDIA's LiLiCorr, arXiv 2608.20530; served by
vLLM 0.32 `model_executor/models/lilicorr.py` and SGLang PR 37462, trained by ModelOpt PR 2342).

Lattice (per drafted block of S = B - 1 slots): the candidates of slot s are the top-K ids of the
drafter's logits there, with their log-probabilities log softmax(logits) (full vocabulary). Each
candidate (s, i) starts as token_proj(embed(id)) + pass_hidden_proj(h_s) + feature_mlp(feature_norm(
[logp, p, logp - max logp, i / (K - 1), i == 0])) + slot_embedding[s] + rank_embedding[i] (h_s: the
drafter's final-normed state of slot s, embed: the target's embedding table); the S x K positions
then run through `lilicorr_num_layers` pre-norm transformer layers (RMSNorm, multi-head attention
over the whole lattice with an additive per-head bias relative_slot_bias[head, slot(q) - slot(k) +
B - 1] + same_slot_bias[head] where the slots agree, RMSNorm, a non-gated SiLU MLP), then
output_norm. The anchor a = context_proj(c) (c: the fused context row just before the block,
hidden_norm(fc(taps)) at the anchor's position - 1; zero where the anchor starts its sample), then
anchor_norm. Per candidate f = silu(factor_input_proj([x, a, x * a])), out = normalize(out_head(f)),
in = normalize(in_head(f)) (L2, eps `lilicorr_vector_eps`); scores, times `lilicorr_logit_scale`:
start[j] = <normalize(anchor_out_head(a)), in[0, j]> for slot 0, pair[s, i, j] = <out[s, i], in[s + 1, j]>
from candidate i of slot s to candidate j of slot s + 1.

Walk (decoding, `LiLiCorrDrafter.propose`, vLLM's `CandidateSampler`): slot 0 picks from start, slot
s > 0 from pair[s - 1, previous pick]; greedy: the argmax; at T > 0 a draw from softmax(row / T),
which is the q the ratio test verifies (0 outside the K candidates).

Training (`LatticeTerm`, ModelOpt's objective): with the data's tokens as the path (teacher forcing),
node scores per slot (start, then the pair row of the gold candidate before), over the supervised
slots (the gold token in the lattice at this slot and every one before it, in a block whose slots
are all supervised): w_ce x cross-entropy over the K candidates, w_margin x hinge relu(margin -
(gold score - best other)), w_pen x the head's expected target rejection sum_j q_j relu(z_gold -
z_j) (z: the target's logits, `needs_target_states`). Released weights 0.25 / 0 / 0.25, margin 2.

Initialisation as ModelOpt's: every Linear of the head normal(0, initializer_range) with zero bias,
the attention's in_proj xavier-uniform (nn.MultiheadAttention's), the three factor heads normal(0,
0.02), embeddings and slot biases 0.

The checkpoint is the DFlash drafter's tensors plus `lilicorr.*`, named as vLLM 0.32's
`LiLiCorrForCausalLM.load_weights` loads them (`lilicorr.layers.i.attn.in_proj_weight` [3h, h], ...;
`lilicorr.token_proj` only where h differs from the drafter's hidden size).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter.config import DrafterConfig
from dflash.drafter.network import DFlashDrafter
from dflash.objective.anchors import to_packed
from dflash.objective.blocks import Blocks
from dflash.objective.loss import Finished, LogitTerm
from dflash.target.model import SharedWeights

NUM_FEATURES = 5  # per candidate: logp, p, logp - max logp, rank / (K - 1), rank == 0
TARGET_STATES, CU_SEQLENS = "target_states", "cu_seqlens"  # the trainer's context keys (`objective.terms`)


class LatticeAttention(nn.Module):
    """Multi-head attention over the lattice with an additive bias (nn.MultiheadAttention's fused
    in_proj, as the release trains and vLLM loads it)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * hidden))
        self.out_proj = nn.Linear(hidden, hidden)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (N, L, h), bias (heads, L, L) -> (N, L, h)."""
        n, length, h = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(n, length, 3, self.heads, -1).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=bias.to(x.dtype)[None])
        return self.out_proj(out.transpose(1, 2).reshape(n, length, h))


class PlainMLP(nn.Module):
    """down_proj(silu(up_proj(x))), with biases (vLLM's NemotronHMLP as LiLiCorr builds it)."""

    def __init__(self, size: int, inner: int, out: int) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(size, inner), nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(hidden, eps=eps), nn.RMSNorm(hidden, eps=eps)
        self.attn = LatticeAttention(hidden, heads)
        self.mlp = PlainMLP(hidden, int(hidden * mlp_ratio), hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LatticeCorrelator(nn.Module):
    """The correlator (`lilicorr.*` of the checkpoint): lattice in, (start, pair) scores out (see the
    module docstring)."""

    def __init__(self, model_hidden: int, block_size: int, settings, eps: float, init_std: float) -> None:
        super().__init__()
        s = settings
        h, K, F_ = s.hidden_size or model_hidden, s.candidate_topk, s.factor_dim
        self.top_k, self.block_size, self.heads = K, block_size, s.num_heads
        self.logit_scale, self.vector_eps = s.logit_scale, s.vector_eps
        self.token_proj = nn.Identity() if h == model_hidden else nn.Linear(model_hidden, h)
        self.pass_hidden_proj = nn.Linear(model_hidden, h)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = PlainMLP(NUM_FEATURES, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, block_size - 1, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, K, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(s.num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(s.num_heads))
        self.context_proj = nn.Linear(model_hidden, h)
        self.layers = nn.ModuleList(LatticeLayer(h, s.num_heads, s.mlp_ratio, eps) for _ in range(s.num_layers))
        self.output_norm, self.anchor_norm = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head, self.in_head, self.anchor_out_head = (nn.Linear(h, F_) for _ in range(3))
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=init_std)
                    nn.init.zeros_(m.bias)
            # random, not zero: zero on both sides of a dot product leaves its gradient 0
            for head in (self.out_head, self.in_head, self.anchor_out_head):
                nn.init.normal_(head.weight, std=0.02)

    def attention_bias(self, slots: int) -> torch.Tensor:
        """(heads, slots K, slots K): the learned bias of a query's and a key's slots."""
        slot = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.top_k)
        rel = slot[:, None] - slot[None, :]
        same = (rel == 0).to(self.same_slot_bias.dtype)
        return self.relative_slot_bias[:, rel + self.block_size - 1] + same[None] * self.same_slot_bias[:, None, None]

    def forward(self, token_embeddings: torch.Tensor, log_probs: torch.Tensor, pass_hidden: torch.Tensor,
                anchor_hidden: torch.Tensor, anchor_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token_embeddings (N, S, K, H) of the candidates, log_probs (N, S, K) float32 descending,
        pass_hidden (N, S, H), anchor_hidden (N, H), anchor_valid (N,) bool -> logit_scale x (start (N, K),
        pair (N, S - 1, K, K)), float32."""
        n, slots, K = log_probs.shape
        dtype = self.slot_embedding.dtype
        rank = torch.arange(K, device=log_probs.device, dtype=torch.float32)
        rank = (rank / (K - 1) if K > 1 else rank).expand_as(log_probs)
        lp = log_probs.float()
        features = torch.stack([lp, lp.exp(), lp - lp.amax(-1, keepdim=True), rank, (rank == 0).float()], -1)
        x = (self.token_proj(token_embeddings.to(dtype)) + self.pass_hidden_proj(pass_hidden.to(dtype))[:, :, None]
             + self.feature_mlp(self.feature_norm(features.to(dtype))) + self.slot_embedding[0, 0, :slots]
             + self.rank_embedding[0, 0])
        x = x.reshape(n, slots * K, -1)
        bias = self.attention_bias(slots)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(n, slots, K, -1)
        a = self.anchor_norm(self.context_proj(anchor_hidden.to(dtype)) * anchor_valid[:, None].to(dtype))
        a4 = a[:, None, None].expand_as(x)
        f = F.silu(self.factor_input_proj(torch.cat([x, a4, x * a4], dim=-1)))
        out = F.normalize(self.out_head(f), dim=-1, eps=self.vector_eps)
        into = F.normalize(self.in_head(f), dim=-1, eps=self.vector_eps)
        anchor_out = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.vector_eps)
        start = (anchor_out[:, None] * into[:, 0]).sum(-1)
        pair = out[:, :-1] @ into[:, 1:].transpose(-1, -2)
        return self.logit_scale * start.float(), self.logit_scale * pair.float()


def walk(start: torch.Tensor, pair: torch.Tensor, temperature: float = 0.0,
         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block's path: start (K,), pair (S - 1, K, K) -> (candidate index per slot (S,), q (S, K) at
    T > 0, else None): each slot's row given the pick before it, its argmax or a draw from softmax(row / T)."""
    picks, qs, row = [], [], start
    for s in range(pair.shape[0] + 1):
        if s:
            row = pair[s - 1, picks[-1]]
        if temperature > 0:
            q = torch.softmax(row / temperature, dim=-1)
            picks.append(torch.multinomial(q, 1, generator=generator)[0])
            qs.append(q)
        else:
            picks.append(row.argmax())
    return torch.stack(picks), torch.stack(qs) if qs else None


class LiLiCorrDrafter(DFlashDrafter):
    """The LiLiCorr drafter (a config of kind lilicorr): the DFlash drafter's modules, built and
    initialised exactly as a DFlash drafter's, then the correlator (`lilicorr`). Same forward; the fused
    context row before each block's anchor, which the correlator reads, is kept by the forward (training,
    the eval walk) and by `draft_hidden` (decoding) for the loss term and `propose`."""

    # Under --optimizer muon these stay on AdamW (`ds_config.muon_split`; the slot and rank embeddings are
    # by their names): a table of per-head biases, no matrix.
    adamw_parameters = ("lilicorr.relative_slot_bias",)
    chooses_drafts = True  # the lattice walk (`propose`)

    def __init__(self, config: DrafterConfig, shared: SharedWeights | None = None, **kwargs) -> None:
        if config.kind_settings is None:
            raise ValueError("a LiLiCorr drafter needs its settings (DrafterConfig.kind_settings)")
        super().__init__(config, shared, **kwargs)
        self.lilicorr = LatticeCorrelator(config.hidden_size, config.block_size, config.kind_settings,
                                          config.rms_norm_eps, config.initializer_range)
        self.block_anchors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused: torch.Tensor | None = None

    def context(self, features: torch.Tensor) -> torch.Tensor:
        fused = super().context(features)
        self._fused = fused  # the training forward's block anchors are rows of it (`forward`)
        return fused

    def forward(self, batch, features: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        hidden = super().forward(batch, features, blocks)
        # the context rows before the anchors, gathered from the fused context the backbone ran (no second
        # fc pass; their gradient joins the context's)
        fused, self._fused = self._fused, None
        packed, a = to_packed(batch), blocks.anchors
        rows = packed.cu_seqlens[a.block_seq.long()].long() + a.block_anchor.long() - 1
        self.block_anchors = (fused[rows.clamp_min(0)], a.block_anchor > 0)
        return hidden

    @torch.no_grad()
    def draft_hidden(self, cache, features: torch.Tensor, anchor_token: int) -> torch.Tensor:
        if features.shape[0]:
            self.block_anchors = (self.context(features[-1:]), torch.ones(1, dtype=torch.bool, device=features.device))
        elif cache.length and self.block_anchors is not None:
            pass  # no new rows: the row before the anchor is still the cache's last, as kept
        else:  # nothing before the anchor (vLLM: anchor_valid false)
            w = self.fc.weight
            self.block_anchors = (w.new_zeros(1, w.shape[0]), torch.zeros(1, dtype=torch.bool, device=w.device))
        hidden = super().draft_hidden(cache, features, anchor_token)
        self._fused = None
        return hidden

    def lattice(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_hidden: torch.Tensor,
                anchor_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden (N, S, H) slot states, logits (N, S, V) theirs -> (candidates (N, S, K), start, pair)."""
        values, candidates = logits.float().topk(self.lilicorr.top_k, dim=-1)
        log_probs = values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        embed = F.embedding(candidates, self._require_shared().embed)
        start, pair = self.lilicorr(embed, log_probs, hidden, anchor_hidden, anchor_valid)
        return candidates, start, pair

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor: int, temperature: float = 0.0,
                generator: torch.Generator | None = None):
        """The lattice walk over slots 1..B-1 of the block `draft_hidden` just drafted: hidden (B-1, H) ->
        (tokens (B-1,), candidates (B-1, K), q (B-1, K) at T > 0, else None). `anchor` (the token) is not
        read: the correlator reads the context row before it."""
        if self.block_anchors is None:
            raise RuntimeError("propose follows draft_hidden (it reads the context row before the anchor)")
        anchor_hidden, valid = self.block_anchors
        candidates, start, pair = self.lattice(hidden[None], self.logits(hidden)[None], anchor_hidden, valid)
        picks, q = walk(start[0], pair[0], temperature, generator)
        return candidates[0].gather(1, picks[:, None])[:, 0], candidates[0], q


class CandidateLogProbs(torch.autograd.Function):
    """log p(c_j) = z_j - logsumexp(z) of each row's candidates (values computed in the lm_head pass), with
    their gradient w.r.t. the row's state h (z = h W^T): d log p(c_j) / d h = W[c_j] - E_p[W], E_p[W]
    (`expected`, rows x H) taken in the same pass. No rows x vocab buffer is kept for backward."""

    @staticmethod
    def forward(ctx, hidden, log_probs, candidates, expected, lm_head):
        ctx.save_for_backward(candidates, expected, lm_head)
        ctx.hidden_dtype = hidden.dtype
        return log_probs.clone()

    @staticmethod
    def backward(ctx, grad):
        candidates, expected, lm_head = ctx.saved_tensors
        out = torch.empty(grad.shape[0], lm_head.shape[1], dtype=torch.float32, device=grad.device)
        for lo in range(0, grad.shape[0], 1024):  # the rows' candidate embeddings, a chunk at a time
            g = grad[lo:lo + 1024].float()
            rows = torch.einsum("rk,rkh->rh", g, lm_head[candidates[lo:lo + 1024]].float())
            out[lo:lo + 1024] = rows - g.sum(1, keepdim=True) * expected[lo:lo + 1024]
        return out.to(ctx.hidden_dtype), None, None, None, None


def lattice_figures(sums: dict, blocks: float) -> dict:
    """The lattice's figures from `LossOutput.metrics` summed over `blocks` blocks: recall (the gold token
    among the top-K) over the scored rows, and over the supervised rows (gold path inside the lattice so
    far) the teacher-forced walk's accuracy and the objective's three parts per row; `argmax_anchor_tau`,
    the acceptance the backbone's own argmax reaches on the same blocks (`anchor_tau` is the walk's)."""
    rows, sup = max(float(sums["lattice_rows"]), 1.0), max(float(sums["lattice_supervised"]), 1.0)
    return {"lattice_recall": float(sums["lattice_recall"]) / rows,
            "lattice_accuracy": float(sums["lattice_correct"]) / sup,
            "lattice_ce": float(sums["lattice_ce_sum"]) / sup,
            "lattice_hinge": float(sums["lattice_hinge_sum"]) / sup,
            "lattice_penalty": float(sums["lattice_penalty_sum"]) / sup,
            "argmax_anchor_tau": float(sums["argmax_tau_sum"]) / blocks if blocks else 0.0}


class LatticeTerm(LogitTerm):
    """The correlator's objective in the loss room (module docstring): per supervised row, ce_weight x CE
    + margin_weight x hinge + penalty_weight x penalty, each weighted per row as the DFlash cross-entropy
    (ModelOpt averages them over the supervised slots instead), summed. The top-K, their logits and the
    log-sum-exp come from each chunk of the lm_head pass; the correlator's gradient reaches the backbone
    through the slot states, the anchor's context row and, as in ModelOpt, the candidates' log-probabilities
    (`CandidateLogProbs`: the pass also keeps each row's expected lm_head row). With `logprob_grad` off
    the log-probabilities are detached inputs, and the pass may run the fused head (top-K and log-sum-exp
    only).

    Metrics (`LossOutput.metrics`, sums): lattice_rows (scored), lattice_recall (gold among the top-K),
    lattice_supervised, lattice_correct (the teacher-forced pick is the gold token), and the three parts'
    row-weighted sums."""

    name = "lattice"
    vocab_buffers = 1  # the log-sum-exp's exponentials
    metric_names = ("lattice_rows", "lattice_recall", "lattice_supervised", "lattice_correct", "lattice_ce_sum",
                    "lattice_hinge_sum", "lattice_penalty_sum")

    def __init__(self, drafter: LiLiCorrDrafter, ce_weight: float = 0.25, margin_weight: float = 0.0,
                 penalty_weight: float = 0.25, margin: float = 2.0, logprob_grad: bool = True):
        super().__init__(1.0)
        weights = (ce_weight, margin_weight, penalty_weight)
        if not all(w >= 0 for w in weights) or not any(weights):
            raise ValueError(f"the lattice weights (ce, margin, penalty) must be >= 0, one > 0: got {weights}")
        if margin_weight and not margin > 0:
            raise ValueError(f"the lattice margin must be > 0 when its weight is, got {margin}")
        self.drafter, self.weights, self.margin = drafter, weights, float(margin)
        self.needs_target_states = penalty_weight > 0  # the penalty reads the target's logits
        self.logprob_grad = bool(logprob_grad)
        self.vocab_buffers = 1 + self.logprob_grad  # the softmax, then its product with the lm_head

    @property
    def top_k(self) -> int:
        return self.drafter.lilicorr.top_k

    @property
    def head_top_k(self) -> int | None:
        return None if self.logprob_grad else self.top_k  # the gradient needs the chunk's softmax

    def figures(self, sums: dict, blocks: float) -> dict:
        return lattice_figures(sums, blocks)

    def words(self, record: dict) -> str:
        if "argmax_tau" not in record:
            return ""
        return (f", the backbone's argmax alone tau {record['argmax_tau']:.3f}, lattice recall "
                f"{record['lattice_recall']:.3f}, accuracy {record['lattice_accuracy']:.3f}")

    def start(self, blocks: Blocks, context: dict) -> None:
        rows, K, device = blocks.labels.numel(), self.top_k, blocks.labels.device
        self._labels = blocks.labels.reshape(-1)
        # rows the fused head skips (weight 0) keep finite stand-ins: they are never supervised
        self._values = torch.zeros(rows, K, dtype=torch.float32, device=device)
        self._candidates = torch.arange(K, device=device).expand(rows, K).clone()
        self._lse = torch.zeros(rows, dtype=torch.float32, device=device)
        self._expected = None
        if self.logprob_grad:
            H = self.drafter.config.hidden_size
            self._expected = torch.zeros(rows, H, dtype=torch.float32, device=device)  # E_p[lm_head row]
        self._states = context.get(TARGET_STATES)
        if self._states is not None:
            cu, a, B = context[CU_SEQLENS].long(), blocks.anchors, blocks.block_size
            first = cu[a.block_seq.long()] + a.block_anchor.long()
            # slot k + 1 is predicted from position anchor + k
            self._positions = (first[:, None] + torch.arange(B - 1, device=device)).clamp(0, self._states.shape[0] - 1)

    def head_chunk(self, stats, rows):
        self._values[rows], self._candidates[rows], self._lse[rows] = stats.top_values, stats.top_ids, stats.lse

    def chunk(self, logits, lo, hi, need_grad):
        self._values[lo:hi], self._candidates[lo:hi] = logits.topk(self.top_k, dim=-1)
        if self._expected is None or not need_grad:  # no gradient: the expected rows are not needed
            self._lse[lo:hi] = torch.logsumexp(logits, dim=-1)
            return logits.new_zeros(()), None
        top = logits.amax(-1, keepdim=True)
        probs = (logits - top).exp_()
        total = probs.sum(-1, keepdim=True)
        self._lse[lo:hi] = (total.log() + top).squeeze(1)
        lm_head = self.drafter.lm_head
        self._expected[lo:hi] = (probs.div_(total).to(lm_head.dtype) @ lm_head).float()
        return logits.new_zeros(()), None

    def finish(self, hidden, blocks, temperatures):
        B, K = blocks.block_size, self.top_k
        S, n = B - 1, blocks.labels.shape[0]
        w_ce, w_margin, w_pen = self.weights
        candidates = self._candidates.view(n, S, K)
        log_probs = self._values - self._lse[:, None]
        if self._expected is not None and torch.is_grad_enabled():
            log_probs = CandidateLogProbs.apply(hidden, log_probs, self._candidates, self._expected,
                                                self.drafter.lm_head)
        log_probs = log_probs.view(n, S, K)
        self._expected = None
        anchor_hidden, anchor_valid = self.drafter.block_anchors
        self.drafter.block_anchors = None  # the graph it holds goes with this loss
        embed = F.embedding(candidates, self.drafter._require_shared().embed)
        start, pair = self.drafter.lilicorr(embed, log_probs, hidden.view(n, S, -1), anchor_hidden, anchor_valid)
        gold = blocks.labels
        hit = candidates == gold[..., None]
        found = hit.any(-1)
        index = hit.float().argmax(-1)  # the gold candidate (0 where absent: that slot's path is already lost)
        # node scores along the gold path: start at slot 0, then the row of the gold candidate before
        rows = pair.gather(2, index[:, :-1, None, None].expand(n, S - 1, 1, K)).squeeze(2)
        node = torch.cat([start[:, None], rows], dim=1)  # (n, S, K)
        valid = blocks.valid
        supervised = found.long().cumprod(1).bool() & valid.all(1, keepdim=True)
        w = blocks.weights.float() * supervised
        logq = torch.log_softmax(node, -1)
        ce = -logq.gather(2, index[..., None]).squeeze(2)
        gold_score = node.gather(2, index[..., None]).squeeze(2)
        others = node.scatter(2, index[..., None], float("-inf")).amax(-1) if K > 1 else gold_score
        hinge = torch.relu(self.margin - (gold_score - others)) if K > 1 else torch.zeros_like(ce)
        penalty = torch.zeros_like(ce)
        if w_pen:
            if self._states is not None:  # without the target's final states it is left out (as DSpark's TV)
                lm_head = self.drafter.lm_head
                states = self._states[self._positions].to(lm_head.dtype)  # (n, S, H)
                z = torch.einsum("nsh,nskh->nsk", states, lm_head[candidates]).float()
                reject = (z.gather(2, index[..., None]) - z).clamp_min(0)
                penalty = (logq.exp() * reject).sum(-1)
        self._states = None
        loss = (w * (w_ce * ce + w_margin * hinge + w_pen * penalty)).sum()
        correct = found & (node.argmax(-1) == index)
        scored = valid
        metrics = {"lattice_rows": scored.sum().float(), "lattice_recall": (found & scored).sum().float(),
                   "lattice_supervised": supervised.sum().float(),
                   "lattice_correct": (correct & supervised).sum().float(),
                   "lattice_ce_sum": (w * ce).sum(), "lattice_hinge_sum": (w * hinge).sum(),
                   "lattice_penalty_sum": (w * penalty).sum()}
        # the eval walk follows the lattice path: where the drafts before a slot are the labels, its draft
        # is the label when the walk picks it, and q_t(label) is its softmax over the K candidates
        node = node.detach()
        label_logq = None
        if temperatures:
            label_logq = torch.stack([torch.log_softmax(node / t, -1).gather(2, index[..., None]).squeeze(2)
                                      for t in temperatures], -1).masked_fill(~found[..., None], float("-inf"))
            label_logq = label_logq.view(n * S, len(temperatures))
        return Finished(loss, {k: v.detach() for k, v in metrics.items()}, correct.reshape(-1), label_logq)
