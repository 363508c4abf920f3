"""One suite every registered drafter kind passes: a kind is covered by registering it (`register`, or a
line of `BUILT_IN`), as the test-only kind of one's own (tests/drafter/gated_kind.py) is here.

Each kind is built small (`DrafterKind.small_settings`, its released layers with a short window) with every
parameter away from its start, and must: read back its config.json, export and reload strictly, train
(every parameter gets a gradient), decode block by block as its packed training forward computes, decode
greedily as the target alone does with the eval walk's acceptance, sample in the target's law (a chi-square
test that can fail), resume a run as if never stopped, fit the memory plan's count of its parameters and
bound of a measured step, cost what its FLOPs say, and state every layer's attention as the engines read it.
What only one kind has (DFlash2's selector, its released names) stays in its own tests."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM

from dflash.data.collate import collate_packed
from dflash.decoding.acceptance import walk_tau
from dflash.decoding.sampling import Sampler, Sampling
from dflash.decoding.speculate import draft_block, greedy_decode, speculative_decode
from dflash.drafter.config_format import SLIDING
from dflash.drafter.kinds import DEFAULT, drafter_kind, kind_names, kind_of_architectures
from dflash.models import (
    Anchors,
    DFlashDrafter,
    DrafterCache,
    DrafterConfig,
    SharedWeights,
    TargetModel,
    draw_blocks,
    slot_weights,
)
from dflash.objective.blocks import Blocks, block_scorer
from dflash.partial import OutputLock
from dflash.sizing.flops import flop_cost_model, measure_flops
from dflash.sizing.memory import DrafterSizes
from dflash.testing import tiny_qwen3_config, train_in_process
from dflash.tools import plan_memory
from dflash.training.config import load_config
from dflash.training.models import training_loss

from ..decoding.test_speculative_sampling import decode_and_count
from ..runs import make_conversations, make_tiny_target, read_metrics, tiny_train_args
from ..training.micro_step import planned_and_measured_micro_step
from . import gated_kind  # noqa: F401 - a kind of one's own, registered by its module
from .checkpoint_helpers import target_config
from .drafter_helpers import MASK_ID, TAPS, B, make_batch, tiny_target
from .test_serving import DEFAULTS, HOSTILE, sglang_layer, vllm_layer

KINDS = kind_names()  # every kind registered when the tests are collected
WINDOW = 6  # a sliding layer's window here: shorter than the contexts, so that it cuts


@pytest.fixture(params=KINDS)
def kind(request):
    return drafter_kind(request.param)


def kind_config(kind, target_config, *, layers=2, taps=TAPS, mask_token_id=MASK_ID, block_size=B, layer_types=None,
                window=None, is_causal=None) -> DrafterConfig:
    """A small drafter of `kind` on `target_config`: its small settings and, unless `layer_types` are
    given, its released layers (a sliding kind's with a window of WINDOW)."""
    if layer_types is None and kind.released_layer_type is not None:
        layer_types, window = [kind.released_layer_type] * layers, WINDOW
        is_causal = kind.released_is_causal
    vocab = target_config.vocab_size
    return DrafterConfig.from_target(target_config, mask_token_id=mask_token_id, block_size=block_size,
                                     draft_layers=layers, target_layer_ids=list(taps), layer_types=layer_types,
                                     sliding_window=window if layer_types and SLIDING in layer_types else None,
                                     is_causal=is_causal, kind=kind.name,
                                     kind_settings=kind.small_settings(target_config.hidden_size, vocab))


def randomized(drafter, seed=0, scale=0.15):
    """Every parameter away from its start (a kind's parts that start as identities included): norms about
    1, the rest of order `scale`, so that every part shows in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else scale * torch.randn(p.shape, generator=g))
    return drafter


def tiny_drafter(kind, target, seed=0, **config):
    config = kind_config(kind, target.config, **config)
    return randomized(kind.network(config, target.shared_weights()), seed)


def options(kind):
    """The training options of a run of `kind` (its own options at their defaults)."""
    return load_config(["--data", "d.jsonl", "--drafter-kind", kind.name])


# ---- config, export -----------------------------------------------------------------------------------


def test_its_config_json_reads_back_as_it_was_and_names_the_kind(kind):
    config = kind_config(kind, tiny_target().config)
    kind.check_settings(config)
    exported = json.loads(json.dumps(config.to_json_dict()))  # as a file holds it
    assert exported["architectures"] == [kind.architecture] and kind_of_architectures(exported["architectures"]) is kind
    assert DrafterConfig.from_json_dict(exported) == config
    if kind.config_keys:  # the keys it computes stay refused in a DFlash drafter's config.json
        exported["architectures"] = [drafter_kind(DEFAULT).architecture]
        with pytest.raises(ValueError, match="which this drafter does not implement"):
            DrafterConfig.from_json_dict(exported)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_export_reloads_strictly_as_the_kinds_network_with_the_same_weights(kind, tmp_path, dtype):
    target = tiny_target()
    drafter = tiny_drafter(kind, target).to(dtype)
    drafter.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved.keys() == drafter.export_tensors().keys()
    loaded = DFlashDrafter.from_pretrained(tmp_path, target.shared_weights())
    assert type(loaded) is kind.network and loaded.config.kind == kind.name
    assert loaded.config.dtype == str(dtype).removeprefix("torch.")  # the dtype written is the weights'
    want, got = drafter.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].dtype == dtype and torch.equal(got[name], want[name]), name
    # a tensor missing or one the network does not have: refused, naming it (engines would skip it silently)
    for change in ("missing", "unknown"):
        tensors = dict(saved)
        if change == "missing":
            del tensors[sorted(tensors)[-1]]
        else:
            tensors["layers.0.extra.weight"] = torch.zeros(2)
        save_file(tensors, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=f"{change} .*'"):
            DFlashDrafter.from_pretrained(tmp_path)


# ---- training -----------------------------------------------------------------------------------------


def blocks_of(batch, num_anchors=6):
    return draw_blocks(batch, block_size=B, num_anchors=num_anchors, mask_token_id=MASK_ID,
                       slot_weights=slot_weights(B, 2.0), seed=0, epoch=0)


def test_its_objective_trains_every_parameter(kind):
    """The run's objective (the cross-entropy, the kind's own terms and logit map) is finite and its
    gradient reaches every parameter of the drafter."""
    target = tiny_target(1)
    drafter = tiny_drafter(kind, target, seed=1)
    batch = make_batch([14, 23], seed=1)
    blocks, feats = blocks_of(batch), target.features(batch)
    with torch.no_grad():  # every other block labelled with the drafter's own argmax: a kind's terms that train
        # only where its candidates hold the label (LiLiCorr's lattice) train there too
        own = drafter.logits(drafter(batch, feats, blocks).view(blocks.num_blocks, B, -1)[:, 1:]).argmax(-1)
    blocks.labels[::2] = torch.where(blocks.valid[::2], own[::2], blocks.labels[::2])
    loss = training_loss(options(kind).loss, B, drafter)
    out = loss(drafter(batch, feats, blocks), blocks, drafter.lm_head)
    assert torch.isfinite(out.loss_sum) and out.weight_sum > 0
    out.loss_sum.backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_decoding_block_by_block_equals_the_packed_training_forward(kind):
    """Decoding's forward (`draft_hidden`: context rows appended to a cache, one block at a time: every
    anchor in turn, then decoding's jumps of 1..B positions) gives the packed training forward's (the
    network's `forward`) scored rows of each block, and
    decoding's greedy drafts (`draft_block`) are those the training states give."""
    target = tiny_target(3)
    drafter = tiny_drafter(kind, target, seed=3).eval()
    lengths = [9, 1, 14]
    batch = make_batch(lengths, seed=3)
    feats = target.features(batch)
    cu = batch.cu_seqlens.tolist()
    seq = [s for s, n in enumerate(lengths) for _ in range(n)]  # a block at every position, the last included
    anchor = [a for n in lengths for a in range(n)]
    anchors = Anchors(torch.tensor(seq, dtype=torch.int32), torch.tensor(anchor, dtype=torch.int32), B, 0)
    greedy, rng = Sampler(Sampling(0.0)), np.random.default_rng(0)
    with torch.no_grad():
        # the kind's own training forward (its block layout), rows 1..B-1: what decoding drafts from
        blocks = Blocks.build(anchors, batch, MASK_ID, slot_weights(B, 2.0))
        training = drafter(batch, feats, blocks).view(-1, B, drafter.config.hidden_size)[:, 1:]
        for s, n in enumerate(lengths):
            for visit in range(2):
                cache, a = DrafterCache(drafter, capacity=n), 0
                while a < n:
                    token = int(batch.input_ids[cu[s] + a])
                    want = training[cu[s] + a]
                    drafts, _ = draft_block(drafter, greedy, cache, feats[cu[s] + cache.length:cu[s] + a], token)
                    # the block's states as the draft saw them (the cache now holds its context)
                    got = drafter.draft_hidden(cache, feats[:0], token)
                    # states reach about 3; the two paths sum in different orders (fp32): ~4e-6 of that apart
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-5)
                    assert drafts == greedy_drafts(drafter, want, token)
                    a += 1 if visit == 0 else int(rng.integers(1, B + 1))


def greedy_drafts(drafter, hidden, anchor) -> list[int]:
    """A block's greedy drafts from its states: the path a network that chooses its drafts proposes, else
    each slot's argmax."""
    if drafter.chooses_drafts:
        return drafter.propose(hidden, anchor)[0].tolist()
    return drafter.logits(hidden).argmax(-1).tolist()


def test_the_flop_model_prices_its_parts_as_a_flop_counter_counts_a_step(kind):
    """A training step (forward, the run's objective, backward) of the kind's drafter minus the same step of
    the DFlash drafter of its sizes, under FlopCounterMode, is exactly `row_flops` per block row, once the
    backbone's own difference is taken out: a kind running fewer query rows than the block's
    (`DrafterKind.query_rows`) saves their layers and attention, which attends to the sample's context
    and so is not a per-row cost (the cost model prices the block's B rows: an upper bound)."""
    import dataclasses

    target = tiny_target(9)
    config = kind_config(kind, target.config)
    batch = make_batch([11, 18], seed=9)
    feats = target.features(batch)
    blocks = blocks_of(batch, num_anchors=4)
    cfg = options(kind)
    plain = DFlashDrafter(dataclasses.replace(config, kind=DEFAULT, kind_settings=None), target.shared_weights())

    def step(drafter):
        loss = training_loss(cfg.loss, B, drafter)
        loss(drafter(batch, feats, blocks), blocks, drafter.lm_head).loss_sum.backward()

    def backbone(rows):
        """The DFlash backbone over the first `rows` rows of every block, forward and backward."""
        a, keep = blocks.anchors, lambda t: t.view(-1, B)[:, :rows].reshape(-1)
        hidden = plain.block_hidden(feats, keep(blocks.input_ids), keep(blocks.position_ids), batch.position_ids,
                                    (batch.cu_seqlens, batch.cu_seqlens_cpu),
                                    Anchors(a.block_seq, a.block_anchor, rows, a.num_skipped))
        hidden.float().pow(2).sum().backward()

    measured = measure_flops(step, randomized(kind.network(config, target.shared_weights())))[0] \
        - measure_flops(step, plain)[0]
    queries = kind.query_rows(B)
    if queries != B:
        measured -= measure_flops(backbone, queries)[0] - measure_flops(backbone, B)[0]
    rows = blocks.input_ids.numel()
    assert rows == blocks.num_blocks * B > 0
    extra = kind.row_flops(config.hidden_size, 2, B, config.kind_settings, cfg.loss, vocab=config.vocab_size)
    assert measured == rows * extra
    sizes = dict(num_target_layers=max(TAPS) + 1, draft_layers=2, num_features=len(TAPS), block_size=B)
    assert flop_cost_model(target.config, **sizes, extra_row_flops=extra).per_row == \
        flop_cost_model(target.config, **sizes).per_row + extra


def test_the_memory_plan_counts_its_parameters(kind):
    target = tiny_target()
    drafter = kind.network(kind_config(kind, target.config, layers=3, taps=(1, 3, 4)))
    sizes = DrafterSizes.from_target(target.config, layers=3, features=3, kind=kind.name,
                                     kind_settings=drafter.config.kind_settings, block_size=B)
    assert sizes.params == sum(p.numel() for p in drafter.parameters())
    assert sizes.layer_params == sum(p.numel() for p in drafter.layers[0].parameters())


# how far above a measured micro-step the plan may be: 10%, less where a kind's is known closer
PLAN_BAND = {DEFAULT: 0.06}


def test_the_memory_plan_bounds_a_measured_micro_step(kind):
    """bf16, the cross-entropy and the kind's own terms: the plan at most 2% below the measured peak and
    `PLAN_BAND` above (tests/sizing/test_memory.py checks the rest of the plan on the DFlash drafter)."""
    target_config = tiny_qwen3_config(vocab_size=512, intermediate_size=192, num_hidden_layers=3)
    settings = kind.small_settings(target_config.hidden_size, target_config.vocab_size)
    estimate, measured, plan, loss = planned_and_measured_micro_step(torch.bfloat16, False, "ce=1", kind.name,
                                                                     settings)
    assert plan.setup.vocab_buffers >= loss.vocab_buffers  # a softcap the kind may have counted, set or not
    assert -0.02 <= estimate / measured - 1 <= PLAN_BAND.get(kind.name, 0.10), (estimate, measured)


def test_plan_memory_plans_it_with_its_costs(kind, capsys, monkeypatch):
    """`launch/plan_memory.py --drafter-kind K` (Qwen3-8B, 8 x 80 GiB): the kind's drafter and settings
    planned, its parts' parameters counted, an anchor ceiling at every length that falls with the length
    and lies at or below the DFlash drafter's."""
    monkeypatch.undo()  # torch.empty unpoisoned: the target is counted on the meta device, not built in memory

    def planned(name):
        plan_memory.main(["--model", "qwen3-8b", "--drafter-kind", name, "--json"])
        return json.loads(capsys.readouterr().out)

    ours, plain = planned(kind.name), planned(DEFAULT)
    drafter = ours["plan"]["drafter"]
    assert drafter["kind"] == kind.name and drafter["kind_settings"] == to_jsonable(kind.released_settings())
    sizes = DrafterSizes(**{**drafter, "kind_settings": kind.released_settings()})
    own = sizes.layers * kind.layer_params(sizes.kind_settings, sizes) + kind.head_params(sizes.kind_settings, sizes)
    assert sizes.params == DrafterSizes(**{**plain["plan"]["drafter"]}).params + own
    ceiling, dflash = ours["replicated"]["anchor_ceiling"], plain["replicated"]["anchor_ceiling"]
    assert list(ceiling.values()) == sorted(ceiling.values(), reverse=True) and min(ceiling.values()) > 0
    assert all(ceiling[n] <= dflash[n] for n in ceiling)


def to_jsonable(settings):
    import dataclasses

    return dataclasses.asdict(settings) if dataclasses.is_dataclass(settings) else settings


# ---- decoding -----------------------------------------------------------------------------------------

VOCAB = 4  # the target of the decoding tests: few tokens, so that random drafts are often accepted


@pytest.fixture(scope="module")
def tiny_hf():
    """A tiny random target of 4 tokens with logits of order 1 (spread distributions): test_speculative_sampling's."""
    torch.manual_seed(0)
    config = tiny_qwen3_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(16.0)
    return hf


def decoding_drafter(kind, hf, block_size=3, seed=4):
    config = kind_config(kind, hf.config, layers=1, taps=[0], mask_token_id=VOCAB - 1, block_size=block_size)
    shared = SharedWeights(hf.get_input_embeddings().weight, hf.lm_head.weight)
    return randomized(kind.network(config, shared, attention_backend="torch"), seed, scale=0.5).eval()


def test_greedy_decoding_is_the_targets_and_accepts_what_the_eval_walk_says(kind, tiny_hf):
    """Speculative decoding gives the target's greedy output, accepting drafts, in as many target forwards
    as the eval walk (the run's objective's blocks, every anchor of the target's turns) counts blocks."""
    hf, limit = tiny_hf, 12
    drafter = decoding_drafter(kind, hf, block_size=4)
    prompts = [[1, 2, 0], [0, 0, 1, 3, 2], [3], [2, 1, 1, 0, 3, 3, 0]]
    tokens = forwards = 0
    samples = []
    for prompt in prompts:
        alone = greedy_decode(hf, prompt, max_new_tokens=limit, stop_ids=[]).tokens
        decoded = speculative_decode(hf, drafter, prompt, max_new_tokens=limit, stop_ids=[])
        assert decoded.tokens == alone  # lossless
        tokens, forwards = tokens + len(decoded.tokens) - 1, forwards + decoded.forwards
        samples.append((np.asarray(prompt + alone), np.asarray([0] * len(prompt) + [1] * limit, dtype=bool)))
    assert forwards < tokens, "drafts were accepted: the equality covers acceptance"
    batch = collate_packed(samples, range(len(samples)))
    loss = training_loss(options(kind).loss, drafter.block_size, drafter, recipe=False)
    score = block_scorer(drafter, loss, drafter.lm_head, mask_token_id=VOCAB - 1,
                         slot_weights=slot_weights(drafter.block_size, 2.0))
    stats = walk_tau(score, batch, TargetModel(hf, [0]).features(batch), block_size=drafter.block_size,
                     max_turn_tokens=limit)
    assert (stats.tokens, stats.blocks) == (tokens, forwards)


def test_speculative_sampling_draws_from_the_targets_law(kind, tiny_hf, monkeypatch):
    """The first 4 tokens of speculative sampling at T 0.7 and top-p 0.8 against the target's own law
    (chi-square, p > 1e-3; tests/decoding/test_speculative_sampling.py shows it fails wrong verification
    rules), every verify branch taken: rejections at each slot and full blocks with their bonus token. The
    drafts' q is a distribution per slot."""
    sampling = Sampling(0.7, top_p=0.8)
    q = torch.cat(decode_and_count(tiny_hf, decoding_drafter(kind, tiny_hf), monkeypatch, sampling, seed=4))
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0]))


# ---- a run --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_target(root / "target"), make_conversations(root / "data.jsonl")


def test_a_stopped_and_resumed_run_equals_the_uninterrupted_one(kind, run_inputs, tmp_path, monkeypatch):
    """`launch/train.py --drafter-kind K` (its one rank in-process): 2 steps, and the same run stopped after
    step 1 and resumed, export the same drafter bitwise, which reloads as the kind's. The run's drafter has
    the kind's small settings, as every drafter of this suite (released, LiLiCorr's 1024-wide correlator
    over a 64-wide target takes minutes a step on a CPU): what a resume restores does not depend on sizes."""
    target, data = run_inputs
    hf = json.loads((target / "config.json").read_text())
    small = kind.small_settings(hf["hidden_size"], hf["vocab_size"])
    monkeypatch.setattr(kind, "released_settings", lambda: small)  # what a new run's drafter is built with
    args = ("--drafter-kind", kind.name, "--max-steps", 2, "--block-size", 4, "--gamma", 2, "--eval-every", 100)
    train_in_process(tiny_train_args(target, data, tmp_path / "whole", *args))
    train_in_process(tiny_train_args(target, data, tmp_path / "stopped", *args, "--stop-at-step", 1))
    # resumed in a copy: this process keeps the stopped run's folder locked (a run's lock lasts its process)
    lock = OutputLock(tmp_path / "stopped", inside=True).path.name  # its name only: no lock taken
    shutil.copytree(tmp_path / "stopped", tmp_path / "resumed", ignore=shutil.ignore_patterns(lock))
    train_in_process(tiny_train_args(target, data, tmp_path / "resumed", *args, "--resume"))
    whole, resumed = (load_file(tmp_path / run / "drafter" / "model.safetensors") for run in ("whole", "resumed"))
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name
    steps = [r["step"] for r in read_metrics(tmp_path / "resumed")]
    assert steps == [1, 2] and all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "whole"))
    exported = DFlashDrafter.from_pretrained(tmp_path / "whole" / "drafter")
    assert type(exported) is kind.network and exported.config.kind_settings == small


# ---- serving ------------------------------------------------------------------------------------------

S, F = SLIDING, "full_attention"
LAYOUTS = [  # layer types, window, is_causal override (None, None: the kind's released layers)
    pytest.param(None, None, None, id="released"),
    pytest.param([F, F, F], None, None, id="full"),
    pytest.param([S, S, F], 6, None, id="sliding-sliding-full"),
    pytest.param([S, S, S], 6, None, id="all sliding"),
    pytest.param([F, F, F], None, True, id="full, is_causal"),
]


@pytest.mark.parametrize("defaults", [DEFAULTS, HOSTILE], ids=["engine defaults", "every default against us"])
@pytest.mark.parametrize("layer_types, window, is_causal", LAYOUTS)
def test_the_export_states_every_layers_attention_as_the_engines_read_it(kind, layer_types, window, is_causal,
                                                                          defaults):
    """vLLM's and SGLang's resolution of each layer's window, causality, RoPE style and sink
    (tests/drafter/test_serving.py) give what the drafter computes, whatever their defaults."""
    config = kind_config(kind, target_config(), layers=3, taps=(1, 3, 6), block_size=16, layer_types=layer_types,
                         window=window, is_causal=is_causal)
    exported = json.loads(json.dumps(config.to_json_dict()))
    for i in range(config.num_hidden_layers):
        computed_window, computed_causal = config.layer_attention(i)
        assert vllm_layer(exported, i, defaults) == (computed_window, computed_causal, True, False), f"layer {i}"
        assert sglang_layer(exported, i, defaults) == (computed_window, computed_causal, True), f"layer {i}"
    assert DrafterConfig.from_json_dict(exported) == config
