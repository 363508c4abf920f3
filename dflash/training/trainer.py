"""The training loop: packed (or padded) micro-batch -> target features -> drafter -> loss ->
DeepSpeed backward/step, with metrics, evaluation, checkpoints and export.

`Trainer(config).train()` reads top to bottom: setup builds the components, the loop walks the
steps of each epoch, everything else is a component (planner, loader, checkpointer, metrics).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from dflash.data.batch import PackedBatch
from dflash.data.planner import DEFAULT_MIX, BatchPlanner, PlannerConfig, plan_batches
from dflash.errors import UserError
from dflash.regenerate import generation_eos, regeneration_limit, stop_ids
from dflash.training.checkpoint import Checkpointer
from dflash.training.config import TrainConfig
from dflash.training.ds_config import load_ds_config, offloads_optimizer, precision, zero_stage
from dflash.training.metrics import MetricsWriter, plot_curves, read_records, step_metrics, trim_jsonl
from dflash.training.ranks import on_rank0
from dflash.training.run_folder import RunFolder
from dflash.training.shared_fs import check_shared_paths
from dflash.training.steps import MicroBatchMaker, micro_batches, step_ranges


def _split(num_samples: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic held-out split: (train indices, eval indices), both sorted."""
    perm = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED])).permutation(num_samples)
    n_eval = int(round(num_samples * eval_fraction)) if eval_fraction > 0 else 0
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1 - progress
        return 1.0

    return f


def accumulate_gradients(engine, target, micro: list, device, block_size: int, timings: list | None = None):
    """Forward and backward of one step's micro-batches on this rank.

    Each micro-batch's loss sum is divided by the loss weight of the WHOLE step (all its
    micro-batches on all ranks), so the accumulated gradient is that of one big batch.
    Returns device tensors (loss, weight, tau, blocks) and (slot correct, slot count), and the
    number of skipped samples; nothing here waits for the device, unless `timings` is a list:
    then each micro-batch's seconds (forward and backward, the device synchronised) are appended.
    """
    if timings is not None:
        from deepspeed.accelerator import get_accelerator
    world_size = dist.get_world_size()
    total = torch.tensor(sum(m.weight_sum for m in micro), dtype=torch.float64, device=device)
    dist.all_reduce(total)  # the step's only collective of ours; the result stays on the device
    # DeepSpeed averages gradients over ranks; scaling by the world size makes that a sum.
    scale = (world_size / total.clamp_min(1e-12)).float()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    slot = torch.zeros(2, block_size - 1, dtype=torch.float64, device=device)
    skipped = 0
    for mb in micro:
        start = time.perf_counter()
        batch = mb.batch.to(device, non_blocking=True)
        out = engine(batch, target.features(batch), plan=mb.plan)
        engine.backward(out.loss_sum * scale, scale_wrt_gas=False)
        if timings is not None:
            get_accelerator().synchronize()
            timings.append(time.perf_counter() - start)
        sums += torch.stack([out.loss_sum.detach().double(), out.weight_sum.double(), out.tau_sum.double(),
                             torch.tensor(float(out.num_blocks), dtype=torch.float64, device=device)])
        slot += torch.stack([out.slot_correct, out.slot_count]).double()
        skipped += out.num_skipped
    return sums, slot, skipped


def init_distributed() -> None:
    """`deepspeed.init_distributed()` on this rank's device, minus the shared memory it leaks on CPU ranks.

    The device comes first: DeepSpeed selects it only inside `deepspeed.initialize`, after the
    target is loaded and the first collectives ran, so every rank of a node would use GPU 0.
    DeepSpeed's CPU all-reduce maps one 66 MB buffer per rank in /dev/shm and never unlinks it,
    so every CPU run (and every killed one) leaves that much RAM behind until reboot. Once all
    ranks have mapped each other's buffers (the barrier), the names can go: mappings outlive them.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed()
    if dist.get_backend() != "gloo":
        return
    dist.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    Path("/dev/shm", name).unlink(missing_ok=True)


class LoadedTarget(NamedTuple):
    """The frozen target and its tokenizer, loaded once; several Trainers may share one."""

    tokenizer: object
    hf: object  # the Hugging Face model (its config sizes the drafter)
    model: object  # the TargetModel feature extractor
    mask_id: int


def load_target(cfg: TrainConfig, device, dtype) -> LoadedTarget:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data.prepare import check_tokenizer_files
    from dflash.models import TargetModel, ensure_mask_token

    target_path = Path(cfg.target)
    if not (target_path / "config.json").is_file():
        raise UserError(f"--target {target_path}: not a Hugging Face model folder (no config.json)")
    check_tokenizer_files(target_path, "--target")
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    hf = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype).to(device)
    try:
        taps = list(cfg.target_layer_ids) if cfg.target_layer_ids else None
        model = TargetModel(hf, taps, num_features=cfg.num_target_features, attention_backend=cfg.attention_backend)
        mask_id = ensure_mask_token(tokenizer, model.num_embedding_rows)
    except ValueError as e:
        raise UserError(f"--target {target_path}: {e}") from None
    return LoadedTarget(tokenizer, hf, model, mask_id)


def init_drafter(cfg: TrainConfig, target_config, target, options: dict):
    """The DFlashDrafter of --init-drafter with its weights (fp32: DeepSpeed casts to the run's
    dtype), checked against the loaded target's embedding; the optimizer starts fresh."""
    import dataclasses as dc

    from dflash.models import DFlashDrafter
    from dflash.models.config import check_fits_target

    drafter = DFlashDrafter.from_pretrained(cfg.init_drafter, **options).float()
    try:  # the layer count was checked with the options (config.init_drafter_config); now the embedding rows
        check_fits_target(drafter.config, target_config, target.num_embedding_rows, num_target_layers_given=False)
    except ValueError as e:
        raise UserError(f"--init-drafter {cfg.init_drafter} does not fit --target {cfg.target}: {e}") from None
    if drafter.config.target_layer_ids != list(target.target_layer_ids):
        raise UserError(f"--init-drafter {cfg.init_drafter}: taps {drafter.config.target_layer_ids} but the target "
                        f"extracts {list(target.target_layer_ids)}")
    # Exported with the target's layer count even when the drafter's config left it out.
    drafter.config = dc.replace(drafter.config, num_target_layers=target_config.num_hidden_layers)
    drafter.attach(target.shared_weights())
    return drafter


class Trainer:
    def __init__(self, cfg: TrainConfig, target: LoadedTarget | None = None):
        """`cfg`: resolved (`config.load_config` / `config.resolve`). `target`: an already loaded
        target to share (e.g. by several modes in one process); it must match cfg's target
        options. None loads it."""
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        from dflash.models import DFlashDrafter, DrafterConfig

        self.cfg = cfg
        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.output_dir = Path(cfg.output_dir)
        check_shared_paths(self.output_dir, {"--target": Path(cfg.target), "--data": Path(cfg.data),
                                             "--deepspeed_config": Path(cfg.deepspeed_config)})
        self.accelerator = get_accelerator()
        self.device = torch.device(self.accelerator.current_device_name())
        on_gpu = self.device.type == "cuda"

        # everything that can be refused is refused before the target loads
        ds_config, self.dtype = self._ds_config(on_gpu)
        data = Path(cfg.data)
        if not data.exists():
            raise UserError(f"--data {data}: no such file or folder")
        self.run_folder = RunFolder(self.output_dir)
        on_rank0(lambda: self.run_folder.claim(resume=cfg.resume, overwrite=cfg.overwrite), "claiming the run folder")

        # target: frozen, features only
        self.loaded = target or load_target(cfg, self.device, self.dtype)
        tokenizer, hf, self.target, mask_id = self.loaded
        torch.manual_seed(cfg.seed)  # after the target: the drafter's init must not depend on who loaded it

        # data: token store -> held-out split -> planner
        store_path = self._token_store(data, tokenizer)
        from dflash.data.token_store import TokenStore

        store = TokenStore(store_path)
        store.check_tokenizer(tokenizer, f"--target {cfg.target}")
        self._check_vocab(store, store_path)
        self._check_lengths(store, store_path)
        usable = int((store.supervised >= 2 * cfg.block_size).sum())
        if usable == 0:
            raise UserError(f"--block-size {cfg.block_size}: a sample needs at least {2 * cfg.block_size} supervised "
                            f"tokens to be trained on, and none of the {len(store):,} samples of {store_path} has "
                            f"(most: {int(store.supervised.max())}); use a smaller block size")
        self.train_idx, self.eval_idx = _split(len(store), cfg.eval_fraction, cfg.seed)
        self.turn_limit = self._turn_limit(store, Path(cfg.data))
        self.stop_ids = stop_ids(tokenizer, generation_eos(cfg.target))
        self._eval_batches = None
        self.lengths = store.lengths[self.train_idx]
        boundaries = cfg.boundaries
        if cfg.order == "bucketed" and boundaries is None:
            from dflash.data.buckets import optimal_buckets

            boundaries = tuple(optimal_buckets(self.lengths, cfg.buckets, cfg.token_budget).tolist())
        # what each sample costs: drafter rows from its anchor candidates, FLOPs from the sizes
        from dflash.data.cost import CostModel, drafter_rows, store_candidates
        from dflash.models.flops import flop_cost_model

        taps = self.target.target_layer_ids
        self.flop_model = flop_cost_model(hf.config, num_target_layers=max(taps) + 1, drafter_layers=cfg.draft_layers,
                                          num_features=len(taps), block_size=cfg.block_size)
        rows = costs = None
        if cfg.balance or cfg.row_budget:
            rows = drafter_rows(store_candidates(store)[self.train_idx], store.supervised[self.train_idx],
                                cfg.block_size, cfg.num_anchors)
        if cfg.balance:
            model = CostModel.load(cfg.cost_model) if cfg.cost_model else self.flop_model
            costs = model.sample_costs(self.lengths, rows)
        self.planner = BatchPlanner(self.lengths, PlannerConfig(
            token_budget=cfg.token_budget, order=cfg.order, layout=cfg.layout, boundaries=boundaries, seed=cfg.seed,
            world_size=self.world_size, window=cfg.packing_window, row_budget=cfg.row_budget or None,
            balance=cfg.balance, mix=max(1, round(cfg.step_tokens / cfg.token_budget)) if cfg.balance else DEFAULT_MIX),
            rows=rows, costs=costs)
        self.steps = [step_ranges(self.planner.plan(e), self.lengths, cfg.step_tokens) for e in range(cfg.epochs)]
        self.total_steps = sum(len(s) for s in self.steps)
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)

        # drafter + DeepSpeed
        options = dict(num_anchors=cfg.num_anchors, gamma=cfg.gamma, attention_backend=cfg.attention_backend,
                       activation_checkpointing=cfg.activation_checkpointing)
        if cfg.init_drafter:
            drafter = init_drafter(cfg, hf.config, self.target, options)
            mask_id = drafter.config.mask_token_id  # what the engines feed the drafter's mask slots
        else:
            dcfg = DrafterConfig.from_target(hf.config, mask_token_id=mask_id, block_size=cfg.block_size,
                                             num_draft_layers=cfg.draft_layers,
                                             target_layer_ids=self.target.target_layer_ids,
                                             vocab_size=self.target.num_embedding_rows,
                                             layer_types=cfg.drafter_layer_types,
                                             sliding_window=cfg.sliding_window or None)
            drafter = DFlashDrafter(dcfg, self.target.shared_weights(), **options)
        self.maker = MicroBatchMaker(str(store_path), cfg.layout, pad_id=tokenizer.pad_token_id or 0,
                                     mask_token_id=mask_id, block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                                     gamma=drafter.gamma, seed=cfg.seed)
        self.zero_stage = zero_stage(ds_config)
        if offloads_optimizer(ds_config):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                          fused=on_gpu or None)
        warmup = int(cfg.warmup_ratio * self.total_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.schedule, warmup, self.total_steps))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=drafter, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        self.drafter = drafter

        self.checkpointer = Checkpointer(self.output_dir, cfg.keep_checkpoints)
        self.step = 0
        self.nonfinite_in_row = self.nonfinite_total = 0
        if self.rank == 0:
            self._say(f"dflash: {self.world_size} rank(s) on {self.device.type}, {self.dtype}, ZeRO-{self.zero_stage}; "
                      f"{len(self.train_idx):,} train / {len(self.eval_idx):,} eval samples "
                      f"({len(store) - usable:,} too short for a block); {cfg.order}-{cfg.layout}, "
                      f"budget {cfg.token_budget:,}, {cfg.step_tokens:,} tokens/rank/step, {self.total_steps} steps")
        resumed = cfg.resume and self._resume()
        if self.rank == 0:  # only now: a refused resume leaves the run's config as it was
            (self.output_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        # a resumed run's logs end at its checkpoint: what a crash wrote after it is redone
        self.metrics = MetricsWriter(self.output_dir, enabled=self.rank == 0,
                                     resume_step=self.step if resumed else None)
        if resumed and cfg.sample_log:
            trim_jsonl(self._sample_log_path(), self.step)
        self._stream = self._micro_steps()

    # ---- setup helpers -------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def _ds_config(self, on_gpu: bool) -> tuple[dict, torch.dtype]:
        """The checked DeepSpeed config and the dtype the run trains in: --dtype, or what the
        JSON switches on (DeepSpeed trains in it whatever the trainer was told)."""
        cfg = self.cfg
        dtype = torch.bfloat16 if cfg.dtype == "bf16" or (cfg.dtype == "auto" and on_gpu) else torch.float32
        ds_config = load_ds_config(cfg.deepspeed_config, world_size=self.world_size, grad_clip=cfg.grad_clip,
                                   bf16=dtype == torch.bfloat16)
        chosen = precision(ds_config)
        if chosen == "fp16":
            raise UserError(f"--deepspeed_config {cfg.deepspeed_config}: fp16 is not supported (the drafter trains in "
                            "bf16 or fp32); use \"bf16\": {\"enabled\": \"auto\"} with --dtype bf16")
        if chosen == "bf16" and cfg.dtype == "fp32":
            raise UserError(f"--deepspeed_config {cfg.deepspeed_config}: enables bf16, but --dtype is fp32; "
                            "write \"bf16\": {\"enabled\": \"auto\"} to follow --dtype")
        return ds_config, torch.bfloat16 if chosen == "bf16" else dtype

    def _token_store(self, data: Path, tokenizer) -> Path:
        """A token store folder as is, or a JSONL file prepared (by rank 0) into the run folder,
        reused while its fingerprints match; a resume refuses one of other data."""
        if data.is_dir():
            return data
        from dflash.data.prepare import ensure_store

        cfg, store = self.cfg, self.output_dir / "data"
        on_rank0(lambda: ensure_store(data, tokenizer, store, max_length=cfg.max_length,
                                      refuse_changes=cfg.resume and not cfg.force_resume, progress=cfg.progress,
                                      say=self._say), "preparing the data")
        return store

    @staticmethod
    def _turn_limit(store, data: Path) -> int | None:
        """The per-turn token limit the data were regenerated with (their `meta`), if they say: eval
        walks and decoding stop there, as the regeneration did."""
        source = data if data.is_file() else Path(store.meta.get("summary", {}).get("input", ""))
        return regeneration_limit(source) if source.is_file() else None

    def _check_vocab(self, store, path) -> None:
        rows = self.target.num_embedding_rows
        if store.vocab_size is not None and store.vocab_size > rows:
            raise UserError(f"--data {path}: tokenized with a vocabulary of {store.vocab_size} tokens, but the "
                            f"target's embedding has {rows} rows; prepare the data with the target's tokenizer")

    def _check_lengths(self, store, path) -> None:
        """A sample over the token budget, named by its store index and source line."""
        over = np.flatnonzero(store.lengths > self.cfg.token_budget)
        if over.size:
            i = int(over[0])
            source = store.meta.get("summary", {}).get("input", "the source file")
            raise UserError(
                f"--data {path}: sample {i} (line {store.dataset[i]['source_line']} of {source}) has "
                f"{int(store.lengths[i])} tokens, more than --token-budget {self.cfg.token_budget} ({over.size} "
                "samples are); raise --token-budget, or prepare the data with a smaller --max-length")

    def _resume(self) -> bool:
        """Load the newest complete checkpoint; False when there is none. A checkpoint of other
        data, planner settings, step size or world size is refused unless --force-resume."""
        cfg = self.cfg

        def check(state):
            diffs = self.planner.load_state_dict(state["planner"], force=True)
            if state["step_tokens"] != cfg.step_tokens:
                diffs.append(f"step_tokens: checkpoint {state['step_tokens']} -> now {cfg.step_tokens}")
            if diffs and not cfg.force_resume:
                raise UserError(f"--resume: {state['checkpoint']} was made with other "
                                "data or settings:\n  " + "\n  ".join(diffs)
                                + "\nresume with the same settings, or add --force-resume to continue anyway "
                                "(the rest of the epoch is replanned)")
            return diffs

        def world_changed(state):
            return state["world_size"] != self.world_size

        state = self.checkpointer.load_latest(self.engine, check, module_only=world_changed)
        if state is None:
            self._say(f"--resume: no complete checkpoint in {self.checkpointer.root}; starting from the beginning")
            return False
        for d in check(state):
            self._say(f"--force-resume: {d}")
        self.step = int(state["step"])
        self.nonfinite_total = int(state.get("nonfinite_steps", 0))
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch_rng"])), dtype=torch.uint8))
        if world_changed(state):
            # DeepSpeed cannot re-partition ZeRO optimizer state for another world size
            self._say(f"--force-resume: {state['world_size']} -> {self.world_size} ranks: the weights are loaded, "
                      "the optimizer state (AdamW moments) starts fresh")
            for _ in range(self.step):
                self.scheduler.step()
            self.planner.position = self.planner.position * state["world_size"] // self.world_size
        epoch, position = self.planner.epoch, self.planner.position
        boundary = next((first for first, _ in self.steps[epoch] if first >= position), None) \
            if epoch < len(self.steps) else position
        if boundary != position:
            # only after a forced resume: continue at the next step of the new plan
            if boundary is None:
                self.planner.epoch, self.planner.position = epoch + 1, 0
            else:
                self.planner.position = boundary
            self._say(f"--force-resume: epoch {epoch} continues at micro-step {self.planner.position} of the new plan "
                      f"(was {position}); samples of this epoch may be repeated or skipped")
        self._say(f"resumed from {state['checkpoint']} at step {self.step} (epoch {self.planner.epoch}, "
                  f"micro-step {self.planner.position})")
        return True

    # ---- the loop ------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.step >= self.total_steps or self.planner.epoch >= self.cfg.epochs

    def _micro_steps(self):
        """This rank's micro-batches, one optimizer step's worth at a time, from where the
        planner stands (0 for a fresh run, the checkpoint's micro-step after a resume)."""
        while not self.done:
            epoch = self.planner.epoch
            ranges = [r for r in self.steps[epoch] if r[0] >= self.planner.position]
            assert ranges and ranges[0][0] == self.planner.position, "_resume leaves the planner on a step boundary"
            batches = [self.train_idx[b] for b in self.planner.plan(epoch)[self.rank]]
            loader = micro_batches(self.maker, batches, epoch, self.planner.position,
                                   num_workers=self.cfg.num_workers, pin_memory=self.device.type == "cuda")
            for first, end in ranges:
                if self.step >= self.total_steps:
                    return
                yield epoch, first, [next(loader) for _ in range(end - first)]

    def train(self) -> dict:
        from tqdm.auto import tqdm

        cfg = self.cfg
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=self.rank != 0 or not cfg.progress, dynamic_ncols=True)
        last_eval = None
        try:
            while not self.done:
                epoch = self.planner.epoch
                record = self.train_step()
                bar.update(1)
                if self.nonfinite_in_row >= cfg.max_nonfinite_steps:
                    self._stop_after_nonfinite_steps()
                epoch_done = self.planner.epoch != epoch  # advance() rolled over
                last = self.step >= self.total_steps
                if record is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}", anchor_tau=f"{record['anchor_tau']:.2f}",
                                    tok_s=f"{record['tokens_per_s']:.0f}")
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or (not cfg.eval_every and epoch_done) or last:
                    last_eval = self.evaluate()
                stop = self.step == cfg.stop_at_step
                if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or \
                        (not cfg.checkpoint_every and epoch_done) or last or stop:
                    self.save_checkpoint()
                if stop:
                    self._say(f"--stop-at-step {self.step}: stopped; continue with --resume")
                    return {"step": self.step, "eval": last_eval, "stopped": True}
        finally:  # also on --stop-at-step and errors: TensorBoard keeps its tail
            bar.close()
            self._stream.close()
            self.metrics.close()
        result = {"step": self.step, "eval": last_eval}
        if cfg.export:
            self.export(self.output_dir / "drafter")
        if self.rank == 0 and self.metrics.path.is_file():
            plot_curves(read_records(self.output_dir), self.output_dir / "curves.png", str(self.output_dir))
            self._say(f"loss and tau curves: {self.output_dir / 'curves.png'}")
        if cfg.export and cfg.speculate_turns and self.eval_idx.size and self.rank == 0:
            result["speculate"] = self.speculate_heldout(self.output_dir / "drafter")
        self.run_folder.release()
        return result

    def train_step(self) -> dict | None:
        """One optimizer step over this rank's next micro-batches; the loss is normalised by the
        loss weight of the WHOLE step (all micro-batches, all ranks), so the gradient is that of
        one big batch. Returns the step's metrics (the same on every rank) on logged steps."""
        cfg, t0 = self.cfg, time.perf_counter()
        epoch, first, micro = next(self._stream)  # waiting for data is part of the step
        timings = [] if cfg.time_micro_batches else None
        sums, slot, skipped = accumulate_gradients(self.engine, self.target, micro, self.device, cfg.block_size,
                                                   timings)
        # The ranks meet before the step's collectives: time spent in this barrier is time spent
        # waiting for the slowest rank (busy: everything before it; under ZeRO-3, or ZeRO-2 with
        # overlap_comm, ranks also meet inside each backward, and that wait counts as busy).
        self.accelerator.synchronize()
        busy = time.perf_counter() - t0
        dist.barrier()
        waited = time.perf_counter() - t0 - busy
        self.engine.step()
        # The ZeRO optimizers skip the update when the global gradient norm is not finite.
        applied = self.engine.was_step_applied()
        self.nonfinite_in_row = 0 if applied else self.nonfinite_in_row + 1
        self.nonfinite_total += not applied
        if not applied:
            self._say(f"step {self.step + 1}: non-finite loss or gradients, update skipped "
                      f"({self.nonfinite_in_row} in a row, {self.nonfinite_total} in all)")
        if cfg.sample_log:
            self._log_samples(micro, epoch, first)
        self.planner.advance(len(micro))
        self.step += 1
        if applied and (self.step - 1) % cfg.log_every and self.step < self.total_steps:
            return None
        # sync point: metrics of the step, summed over ranks; each rank's own time (its queued
        # device work included) and work in its slot, so one all_reduce gathers them all
        self.accelerator.synchronize()
        own = time.perf_counter() - t0
        per_rank = torch.zeros(5, self.world_size, dtype=torch.float64, device=self.device)
        per_rank[:, self.rank] = torch.tensor([own, sum(m.real_tokens for m in micro),
                                               sum(m.computed_tokens for m in micro), busy, waited],
                                              dtype=torch.float64)
        counts = torch.tensor([skipped, len(micro)], dtype=torch.float64, device=self.device)
        for t in (sums, slot, per_rank, counts):
            dist.all_reduce(t)
        seconds = time.perf_counter() - t0
        rank_seconds, rank_real, rank_computed, rank_busy, rank_waited = per_rank.tolist()
        real, computed = sum(rank_real), sum(rank_computed)
        grad_norm = self.engine.get_global_grad_norm()
        metrics = step_metrics(sums.tolist(), slot)
        record = {
            "epoch": epoch, "loss": metrics["loss"], "anchor_tau": metrics["anchor_tau"],
            "lr": self.scheduler.get_last_lr()[0], "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "step_seconds": seconds, "real_tokens": int(real), "computed_tokens": int(computed),
            "tokens_per_s": real / seconds, "computed_tokens_per_s": computed / seconds,
            "efficiency": real / computed, "micro_batches": int(counts[1]) // self.world_size,
            "skipped_samples": int(counts[0]), "step_applied": applied, "nonfinite_steps": self.nonfinite_total,
            "slot_accuracy": metrics["slot_accuracy"],
            "rank_seconds": rank_seconds, "rank_computed_tokens": [int(c) for c in rank_computed],
            # per rank: seconds of work before the step's collectives, and seconds waited there for the slowest
            "rank_busy_seconds": rank_busy, "rank_wait_seconds": rank_waited,
            "wait_fraction": sum(rank_waited) / (self.world_size * seconds),
        }
        if timings is not None:  # every rank's micro-batches: cost features and measured seconds
            mine = [[*m.cost_features.tolist(), t] for m, t in zip(micro, timings, strict=True)]
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
            record["micro_batch_costs"] = [row for rank_rows in gathered for row in rank_rows]
        if self.device.type == "cuda":  # for the config tuner: what this rank's step needed at most
            record["peak_memory_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        self.metrics.write("train", self.step, record)
        return record

    def _stop_after_nonfinite_steps(self) -> None:
        first = self.step - self.nonfinite_in_row + 1
        # skipped updates left the weights and optimizer as they were after step first - 1
        path = self.save_checkpoint()
        raise UserError(
            f"steps {first}-{self.step}: {self.nonfinite_in_row} optimizer steps in a row had non-finite loss or "
            f"gradients and were skipped (--max-nonfinite-steps {self.cfg.max_nonfinite_steps}); stopped with a "
            f"checkpoint of the last good weights in {path}. Likely causes: a learning rate too high (--lr), "
            "bf16 overflow (--dtype fp32), or bad samples (--sample-log writes which samples each step used). "
            "--resume continues after these steps.")

    def _sample_log_path(self) -> Path:
        return self.output_dir / f"samples.rank{self.rank}.jsonl"

    def _log_samples(self, micro, epoch: int, first: int) -> None:
        with open(self._sample_log_path(), "a") as f:
            f.write(json.dumps({"step": self.step + 1, "epoch": epoch, "micro_step": first,
                                "samples": [m.batch.sample_ids.tolist() for m in micro]}) + "\n")

    def _eval_batch(self, indices) -> PackedBatch:
        """Held-out samples packed, every turn cut where decoding stops: its first stop token, or the
        token limit the data were regenerated with."""
        from dflash.data.collate import collate_packed
        from dflash.models.acceptance import limited

        return limited(collate_packed(self.maker.store, self.eval_idx[indices]), self.turn_limit, self.stop_ids)

    def _eval_plan(self) -> tuple[list, list[int]]:
        """Held-out micro-batches (sorted, packed) and how many drafter forwards each takes (cached)."""
        from dflash.models.acceptance import every_anchor

        if self._eval_batches is None:
            lengths = self.maker.store.lengths[self.eval_idx]
            batches = plan_batches(lengths, self.cfg.token_budget, "sorted", "packed", seed=self.cfg.seed)[0]
            chunks = [len(every_anchor(self._eval_batch(b), self.cfg.block_size)) for b in batches]
            self._eval_batches = (batches, chunks)
        return self._eval_batches

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Walk tau on the held-out split: a block at every position of every assistant turn (short
        ones too), walked as greedy speculative decoding does (`dflash.models.acceptance`); beside
        it anchor_tau (the mean over those blocks), per-slot accuracy and the loss."""
        from dflash.models.acceptance import WalkStats, every_anchor, score_and_walk

        if self.eval_idx.size == 0:
            return None
        B = self.cfg.block_size
        batches, chunks = self._eval_plan()
        # Round-robin over ranks. Every rank runs the same number of forwards (ZeRO-3 gathers
        # parameters collectively), so a rank with fewer repeats one and discards it.
        forwards = max(sum(chunks[r::self.world_size]) for r in range(self.world_size))
        stats, done = WalkStats(B), 0

        def forward(batch, features, plan):
            return self.engine(batch, features, plan=plan)

        for k in range(self.rank, len(batches), self.world_size):
            batch = self._eval_batch(batches[k]).to(self.device)
            plans = every_anchor(batch, B)
            stats.add(score_and_walk(forward, batch, self.target.features(batch), plans, block_size=B))
            done += len(plans)
        if done < forwards:
            batch = self._eval_batch(batches[next(k for k, c in enumerate(chunks) if c)]).to(self.device)
            features, plan = self.target.features(batch), every_anchor(batch, B)[0]
            for _ in range(forwards - done):
                forward(batch, features, plan)
        total = stats.to_tensor(self.device)
        dist.all_reduce(total)
        record = WalkStats.from_tensor(total, B).metrics()
        self.metrics.write("eval", self.step, record)
        self._say(f"eval @ step {self.step}: loss {record['loss']:.4f}, tau {record['tau']:.3f} (decoding walk: "
                  f"{record['tokens']:,} tokens in {record['blocks']:,} blocks, {record['turns']} turns), "
                  f"anchor_tau {record['anchor_tau']:.3f}")
        return record

    def speculate_heldout(self, drafter_dir: Path) -> dict:
        """Greedy speculative decoding of the first held-out turns with the exported drafter (rank 0):
        the acceptance length decoding reaches, to set beside the eval walk tau."""
        from dflash.models import DFlashDrafter
        from dflash.models.speculate import DEFAULT_MAX_NEW_TOKENS, prompts_from_samples, speculate

        cfg = self.cfg
        prompts = prompts_from_samples((self.maker.store[int(i)] for i in self.eval_idx), cfg.speculate_turns)
        drafter = DFlashDrafter.from_pretrained(drafter_dir, self.target.shared_weights())
        drafter.to(self.device, self.dtype).eval()
        limit = self.turn_limit or DEFAULT_MAX_NEW_TOKENS
        report = speculate(self.loaded.hf, drafter, prompts, max_new_tokens=limit, stop_ids=self.stop_ids,
                           reference=False, progress=cfg.progress).summary()
        result = {"step": self.step, "max_new_tokens": limit, **report}
        (self.output_dir / "speculate.json").write_text(json.dumps(result, indent=2) + "\n")
        self._say(f"speculative decoding of {report['turns']} held-out turns: acceptance length "
                  f"{report['acceptance_length']:.3f} ({report['tokens']:,} tokens, {report['target_forwards']:,} "
                  f"target forwards after the prefills, {report['speculative_tokens_per_s']:.0f} tokens/s); "
                  f"against the target alone: python launch/speculate.py --drafter {drafter_dir}")
        return result

    def save_checkpoint(self) -> Path:
        state = {"planner": self.planner.state_dict(), "step_tokens": self.cfg.step_tokens,
                 "world_size": self.world_size,
                 "nonfinite_steps": self.nonfinite_total, "config": dataclasses.asdict(self.cfg),
                 "torch_rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
        return self.checkpointer.save(self.engine, self.step, state)

    def export(self, directory: Path) -> None:
        """The drafter in the official DFlash format (parameters gathered under ZeRO-3)."""
        import deepspeed

        params = list(self.drafter.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.zero_stage == 3):
            on_rank0(lambda: self.drafter.save_pretrained(directory), "exporting the drafter")
        self._say(f"exported the drafter to {directory}")
