"""The DSpark drafter: a DFlash backbone that drafts a block in one parallel pass, a low-rank Markov head
that makes each draft depend on the one sampled before it, and a per-position confidence head.

Layout (anchor as the first prediction, vLLM's `sample_from_anchor`): a block of `block_size` B holds
the anchor (the last verified token) and B - 1 labels, as a DFlash block does, but the backbone runs
N = B - 1 query rows, [anchor, mask x (N-1)] at positions a .. a+N-1, and query row k predicts the token
at a+k+1 (the next token, not its own position's). So a DSpark block proposes B - 1 drafts, the number a
DFlash block of the same `block_size` proposes, with one query row less. In the packed training layout
`DSparkDrafter.forward` returns the B rows the loss reads: row k (k >= 1) is query row k - 1's state,
row 0 (never scored) zeros.

Markov head: `markov_w1` (V x r) embeds the previous token, `markov_w2` (V x r) maps that embedding to a
bias over the vocabulary: the logits of query row k are lm_head(h_k) + markov_w2 markov_w1[prev_k], prev_0
the anchor and prev_k the draft of row k-1. Decoding samples left to right (`DSparkDrafter.propose`):
greedy the argmax of each row given the previous draft, at T > 0 a draw from softmax(logits / T), whose
distribution is the q the ratio test needs (each q conditioned on the drafts before it).

Confidence head: sigmoid(proj([h_k, markov_w1[prev_k]])) estimates the chance that row k's draft is
accepted (vLLM reads it for adaptive verification); it is not used to choose drafts.

Training (the DSpark authors' objective, DeepSpec as ported to SpecForge, speculators, TorchSpec,
ModelOpt): with the data's tokens as the previous tokens (teacher forcing) and the DFlash slot weights
w_k, `MarkovTerm` sums w_k (ce_weight x CE(Markov-biased logits, label) + tv_weight x TV(q, p)), TV the
total variation 0.5 |q - p|_1 between the drafter's softmax q and the target's next-token distribution p
(the target's final states through the shared lm_head), and `ConfidenceTerm` the binary cross-entropy
of the confidence against 1 - TV, the chance that speculative sampling accepts the draft (detached). The
released weights are 0.1, 0.9 and 1.0. Without the target's states (the held-out walk) the TV part is
left out and the confidence's target is whether the row's Markov draft is the label.

Initialisation: `markov_w2` starts at 0 (no bias: a new DSpark drafter drafts as its backbone does).

The checkpoint is vLLM 0.32's `Qwen3DSparkForCausalLM` (`model_executor/models/qwen3_dspark.py`): the
DFlash drafter's tensors, `markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r],
`confidence_head.proj.{weight [1, H + r], bias [1]}`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.data.batch import PackedBatch, PaddedBatch
from dflash.drafter.config import DrafterConfig
from dflash.drafter.network import DFlashDrafter, DrafterCache
from dflash.objective.anchors import Anchors, to_packed
from dflash.objective.blocks import Blocks
from dflash.objective.loss import DEFAULT_CHUNK_ROWS, Finished, LogitTerm
from dflash.objective.terms import CU_SEQLENS, TARGET_STATES, _TargetDistributionTerm
from dflash.target.model import SharedWeights


class MarkovHead(nn.Module):
    """The low-rank transition bias: bias(prev) = markov_w2 markov_w1[prev], (N,) ids -> (N, V)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)

    def forward(self, prev: torch.Tensor, embed_grad: torch.Tensor | None = None,
                w2_grad: torch.Tensor | None = None):
        """Without gradients given: (markov_w1[prev], markov_w2's weight), detached float32 copies (what a
        training term reads between its chunks; copies, as ZeRO-3 frees gathered weights after a forward).
        With them: sum(markov_w1[prev] * embed_grad) + sum(markov_w2 * w2_grad), whose gradient puts the
        gradients the term accumulated on the head's weights."""
        embed = self.markov_w1(prev)
        if embed_grad is None:
            return embed.detach().float().clone(), self.markov_w2.weight.detach().float().clone()
        return (embed.float() * embed_grad).sum() + (self.markov_w2.weight.float() * w2_grad).sum()

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, embed: torch.Tensor) -> torch.Tensor:
        return embed.float() @ self.markov_w2.weight.float().t()


class ConfidenceHead(nn.Module):
    """proj([hidden, markov embedding]) (or of the hidden alone), computed in float32 as vLLM does."""

    def __init__(self, input_dim: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Logits (N,) of the acceptance probability."""
        x = torch.cat([hidden, embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


def markov_logits(base: torch.Tensor, head: MarkovHead, prev: torch.Tensor) -> torch.Tensor:
    """base (N, V) logits and prev (N,) previous tokens -> (N, V) float32: the logits a DSpark row samples."""
    return base.float() + head.bias(head.embed(prev))


class DSparkDrafter(DFlashDrafter):
    """The DSpark drafter (a config of kind dspark): the DFlash drafter's modules, built and initialised
    first exactly as a DFlash drafter's, then the Markov head and, if enabled, the confidence head."""

    # Under --optimizer muon these stay on AdamW: the Markov embedding is a lookup table (as embeddings are),
    # the confidence projection a single row (no matrix to orthogonalise).
    adamw_parameters = ("markov_head.markov_w1.weight", "confidence_head.proj.weight")
    chooses_drafts = True  # the Markov head's left-to-right path (`propose`)

    def __init__(self, config: DrafterConfig, shared: SharedWeights | None = None, **kwargs) -> None:
        if config.kind_settings is None:
            raise ValueError("a DSpark drafter needs its settings (DrafterConfig.kind_settings)")
        super().__init__(config, shared, **kwargs)
        s, H = config.kind_settings, config.hidden_size
        self.markov_head = MarkovHead(config.vocab_size, s.markov_rank)
        self.confidence_head = None
        if s.enable_confidence_head:
            width = H + s.markov_rank if s.confidence_head_with_markov else H
            self.confidence_head = ConfidenceHead(width, s.confidence_head_with_markov)
            nn.init.normal_(self.confidence_head.proj.weight, std=config.initializer_range)
            nn.init.zeros_(self.confidence_head.proj.bias)

    @property
    def queries(self) -> int:
        """Query rows of a block (and drafts): block_size - 1, the anchor the first of them."""
        return self.block_size - 1

    def forward(self, batch: PackedBatch | PaddedBatch, features: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        """The training forward: (NB*B, H), row k >= 1 of a block the state of query row k - 1 (which predicts
        the label at anchor + k), row 0 zeros (the loss never scores it)."""
        packed = to_packed(batch)
        if features.shape[0] != packed.input_ids.shape[0]:
            raise ValueError(f"features cover {features.shape[0]} tokens, the batch has {packed.input_ids.shape[0]}")
        B, N = blocks.block_size, blocks.block_size - 1
        a = blocks.anchors
        ids = blocks.input_ids.view(-1, B)[:, :N].reshape(-1)
        positions = blocks.position_ids.view(-1, B)[:, :N].reshape(-1)
        hidden = self.block_hidden(features, ids, positions, packed.position_ids,
                                   (packed.cu_seqlens, packed.cu_seqlens_cpu),
                                   Anchors(a.block_seq, a.block_anchor, N, a.num_skipped))
        hidden = hidden.view(-1, N, hidden.shape[-1])
        return torch.cat([hidden.new_zeros(hidden.shape[0], 1, hidden.shape[2]), hidden], 1).flatten(0, 1)

    @torch.no_grad()
    def draft_hidden(self, cache: DrafterCache, features: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """The states of the N query rows of the block anchored after the cache's rows, (N, H): row k
        predicts the token after the anchor's position + k."""
        N, device = self.queries, self.fc.weight.device
        start = cache.length + features.shape[0]
        ids = torch.full((N,), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0] = anchor_token
        cu = torch.tensor([0, start], dtype=torch.int32)
        anchors = Anchors(torch.zeros(1, dtype=torch.int32), torch.tensor([start], dtype=torch.int32), N, 0)
        return self.block_hidden(features, ids, torch.arange(start, start + N, device=device),
                                 torch.arange(cache.length, start, device=device), (cu.to(device), cu),
                                 anchors.to(device), cache)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor: int, temperature: float = 0.0,
                generator: torch.Generator | None = None):
        """The sequential stage: hidden (N, H) the query rows' states -> (drafts (N,), candidates (N, V) all
        tokens, q (N, V) each draft's distribution given the drafts before it at T > 0, else None)."""
        base = self.logits(hidden)
        prev = torch.tensor([anchor], device=hidden.device)
        path, qs = [], []
        for k in range(hidden.shape[0]):
            logits = markov_logits(base[k:k + 1], self.markov_head, prev)[0]
            if temperature > 0:
                q = torch.softmax(logits / temperature, dim=-1)
                prev = torch.multinomial(q, 1, generator=generator)
                qs.append(q)
            else:
                prev = logits.argmax().view(1)
            path.append(prev)
        vocab = torch.arange(base.shape[1], device=hidden.device).expand(base.shape[0], -1)
        return torch.cat(path), vocab, torch.stack(qs) if qs else None

    @torch.no_grad()
    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The acceptance probability (N,) of each row's draft, prev (N,) the token before each draft
        (the anchor, then the drafts), as vLLM's `compute_confidence`."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head false)")
        return torch.sigmoid(self.confidence_head(hidden, self.markov_head.embed(prev)))


def previous_tokens(blocks: Blocks) -> torch.Tensor:
    """(NB*(B-1),) the token before each scored row's label, as the data have it (teacher forcing):
    the anchor, then the labels before it."""
    anchors = blocks.input_ids.view(-1, blocks.block_size)[:, :1]
    return torch.cat([anchors, blocks.labels[:, :-1]], dim=1).reshape(-1)


def markov_figures(sums: dict, blocks: float) -> dict:
    """The Markov term's figures from its sums over `blocks` blocks: the teacher-forced accuracy of the
    Markov path, its mean CE per scored row and TV per row that had the target's distribution, and
    `argmax_anchor_tau`, the acceptance the backbone's own argmax reaches on the same blocks (`anchor_tau`
    is the Markov path's)."""
    rows = max(float(sums["markov_rows"]), 1.0)
    out = {"markov_accuracy": float(sums["markov_correct"]) / rows, "markov_ce": float(sums["markov_ce"]) / rows,
           "argmax_anchor_tau": float(sums["argmax_tau_sum"]) / blocks if blocks else 0.0}
    if float(sums["markov_tv_rows"]):  # TV only where the target's distribution was there (training steps)
        out["markov_tv"] = float(sums["markov_tv"]) / float(sums["markov_tv_rows"])
    return out


def markov_buffers(tv: bool) -> int:
    """The (chunk x vocab) float32 buffers `MarkovTerm` holds at once, with or without its TV part: the
    biased logits (then their softmax) and the gradient; with TV, the target's probabilities of the rows
    (made first: the target's logits and softmax of the chunk's positions, then the rows', at once)."""
    return 3 if tv else 2


class MarkovTerm(_TargetDistributionTerm):
    """The Markov-biased objective in the loss room: per scored row, w x (ce_weight x CE + tv_weight x TV)
    of the logits base + bias(prev), prev the data's token before the label (see the module docstring).

    Each chunk adds the bias to its logits (one more chunk x vocab buffer), and returns the gradient with
    respect to the base logits (the backbone's); the head's own gradients are accumulated per chunk
    (d embedding (rows, r), d markov_w2 (V, r), float32) and put on its weights in `finish` through the
    head's forward. The TV part needs the target's final states (`needs_target_states`); without them it
    is left out. Metrics: markov_rows, markov_correct (the Markov argmax is the label), markov_ce, markov_tv and
    markov_tv_rows (the rows it was computed on).
    """

    name = "markov"
    vocab_buffers = 3  # `markov_buffers`
    metric_names = ("markov_rows", "markov_correct", "markov_ce", "markov_tv", "markov_tv_rows")

    def __init__(self, head: MarkovHead, weight: float = 1.0, *, ce_weight: float = 0.1, tv_weight: float = 0.9,
                 lm_head: torch.Tensor | None = None):
        super().__init__(weight, 1.0, lm_head=lm_head)
        self.head, self.ce_weight, self.tv_weight = head, float(ce_weight), float(tv_weight)
        self.needs_target_states = self.tv_weight > 0
        self.vocab_buffers = markov_buffers(self.needs_target_states)

    def start(self, blocks: Blocks, context: dict) -> None:
        self.targets = self.tv_weight > 0 and TARGET_STATES in context and CU_SEQLENS in context
        if self.targets:
            super().start(blocks, context)
        self.labels = blocks.labels.reshape(-1)
        self.row_weights = blocks.weights.reshape(-1)
        self.prev = previous_tokens(blocks)
        self.embed, self.w2 = self.head(self.prev)
        rows, device = self.labels.numel(), self.labels.device
        self.embed_grad, self.w2_grad = torch.zeros_like(self.embed), torch.zeros_like(self.w2)
        self.correct = torch.zeros(rows, dtype=torch.bool, device=device)
        self.ce = torch.zeros(rows, dtype=torch.float32, device=device)
        self.tv = torch.zeros(rows, dtype=torch.float32, device=device)
        self.grads = False

    def chunk(self, logits, lo, hi, need_grad):
        labels, w = self.labels[lo:hi], self.row_weights[lo:hi].float()
        embed = self.embed[lo:hi]
        p = None
        if self.targets:  # first, while no buffer of the drafter's is held: at most 3 beside the logits
            unique, inverse = self.target_probs(lo, hi)
            p = unique[inverse]
            del unique
        z = torch.addmm(logits, embed, self.w2.t())  # base + bias, a new buffer
        self.correct[lo:hi] = z.argmax(dim=-1) == labels
        gold = z.gather(1, labels[:, None]).squeeze(1)
        top = z.amax(dim=-1, keepdim=True)
        q = z.sub_(top).exp_()
        total = q.sum(dim=-1, keepdim=True)
        q.div_(total)
        ce = (total.log() + top).squeeze(1) - gold
        self.ce[lo:hi] = ce
        part = self.ce_weight * (w * ce).sum()
        grad = None
        if need_grad:  # ce_weight w (q - onehot)
            grad = q * (self.ce_weight * w)[:, None]
            grad[torch.arange(hi - lo, device=grad.device), labels] -= self.ce_weight * w
        if p is not None:
            sign = p.sub_(q).neg_()  # q - p, in p's place
            tv = 0.5 * sign.abs().sum(dim=-1)
            self.tv[lo:hi] = tv
            part = part + self.tv_weight * (w * tv).sum()
            if need_grad:  # d TV / d z = 0.5 q (s - <s, q>), s = sign(q - p)
                sign.sign_()
                mean = torch.einsum("rv,rv->r", sign, q)[:, None]  # per row, with no (rows, V) product held
                grad.add_(sign.sub_(mean).mul_(q).mul_((0.5 * self.tv_weight * w)[:, None]))
            del sign, p
        del q
        if need_grad:
            self.embed_grad[lo:hi] = grad @ self.w2
            self.w2_grad.addmm_(grad.t(), embed)
            self.grads = True
        return part, grad

    def finish(self, hidden, blocks, temperatures):
        loss = hidden.new_zeros((), dtype=torch.float32)
        if self.grads and torch.is_grad_enabled():
            surrogate = self.head(self.prev, self.embed_grad, self.w2_grad)
            loss = surrogate - surrogate.detach()  # no value (the chunks counted it), the head's gradient
        scored = blocks.valid.reshape(-1)
        metrics = {"markov_rows": scored.sum().float(), "markov_correct": (self.correct & scored).sum().float(),
                   "markov_ce": (self.ce * scored).sum(), "markov_tv": (self.tv * scored).sum(),
                   "markov_tv_rows": scored.sum().float() * self.targets}
        logq = self.label_logq(hidden, temperatures) if temperatures else None
        self.states = self.embed_grad = self.w2_grad = self.w2 = None
        return Finished(loss, metrics, self.correct, logq)

    @torch.no_grad()
    def label_logq(self, hidden: torch.Tensor, temperatures: tuple[float, ...]) -> torch.Tensor:
        """(rows, len(temperatures)) log softmax(Markov-biased logits / t)[label]: the walk at temperature
        reads the Markov path's q. The chunks saw no temperatures, so this runs the lm_head again, in
        chunks of the pass's size (only the evaluation asks for it)."""
        out = hidden.new_empty(hidden.shape[0], len(temperatures), dtype=torch.float32)
        for lo in range(0, hidden.shape[0], DEFAULT_CHUNK_ROWS):
            hi = min(lo + DEFAULT_CHUNK_ROWS, hidden.shape[0])
            z = (hidden[lo:hi].to(self.lm_head.dtype) @ self.lm_head.t()).float()
            z.addmm_(self.embed[lo:hi], self.w2.t())
            gold = z.gather(1, self.labels[lo:hi, None]).squeeze(1)
            for i, t in enumerate(temperatures):
                out[lo:hi, i] = gold / t - torch.logsumexp(z / t, dim=-1)
        return out

    def figures(self, sums: dict, blocks: float) -> dict:
        return markov_figures(sums, blocks)

    def words(self, record: dict) -> str:
        if "markov_accuracy" not in record:
            return ""
        tv = f", TV {record['markov_tv']:.3f}" if "markov_tv" in record else ""
        return (f", the backbone's argmax alone tau {record['argmax_anchor_tau']:.3f}, Markov accuracy "
                f"{record['markov_accuracy']:.3f}{tv}")


class ConfidenceTerm(LogitTerm):
    """The confidence head's binary cross-entropy per scored row, weighted as the DFlash cross-entropy:
    target 1 - TV of the Markov term's row (the acceptance chance of speculative sampling), or, without
    the target's states, whether its Markov draft is the label. The head reads the backbone's states and
    the Markov embeddings detached (it learns to read them, not to move them).
    Metrics: confidence_mean and confidence_target (sums over scored rows: calibration at a glance)."""

    name = "confidence"
    vocab_buffers = 0
    metric_names = ("confidence_rows", "confidence_mean", "confidence_target")

    def __init__(self, head: ConfidenceHead, markov: MarkovTerm, weight: float = 1.0):
        super().__init__(weight)
        self.head, self.markov = head, markov

    def chunk(self, logits, lo, hi, need_grad):
        return logits.new_zeros(()), None

    def finish(self, hidden, blocks, temperatures):
        m = self.markov
        target = (1 - m.tv) if m.targets else m.correct.float()
        logits = self.head(hidden.detach(), m.embed.to(hidden.dtype))
        w = blocks.weights.reshape(-1).float()
        bce = F.binary_cross_entropy_with_logits(logits, target.clamp(0, 1), reduction="none")
        scored = blocks.valid.reshape(-1).float()
        metrics = {"confidence_rows": scored.sum(), "confidence_mean": (torch.sigmoid(logits.detach()) * scored).sum(),
                   "confidence_target": (target * scored).sum()}
        return Finished((bce * w).sum(), metrics)

    def figures(self, sums: dict, blocks: float) -> dict:
        rows = max(float(sums["confidence_rows"]), 1.0)
        return {"confidence_mean": float(sums["confidence_mean"]) / rows,
                "confidence_target": float(sums["confidence_target"]) / rows}

    def words(self, record: dict) -> str:
        if "confidence_mean" not in record:
            return ""
        return f", confidence {record['confidence_mean']:.3f} (target {record['confidence_target']:.3f})"
