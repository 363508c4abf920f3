"""The training loop: packed (or padded) micro-batch -> target features -> drafter -> loss ->
DeepSpeed backward/step, with metrics, evaluation, checkpoints and export.

`Trainer(config).train()` reads top to bottom. Setup composes the parts built from the config
(`TrainingData`: store, split, planner, steps; `Models`: target, drafter, engine; `Evaluator`:
eval walk and held-out decoding; `Checkpointer`); the loop walks the optimizer steps of each
epoch, with evaluation, checkpoints and the export around them.
"""
from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.data.synthetic import is_synthetic
from dflash.distributed.partition import target_bytes, target_summary
from dflash.distributed.process_group import init_distributed
from dflash.distributed.ranks import on_rank0
from dflash.distributed.run_folder import RunFolder, RunPaths
from dflash.distributed.shared_fs import check_shared_paths
from dflash.errors import DiskFull, UserError, allocation_failed
from dflash.partial import check_apart, write_json
from dflash.sizing.fit import accelerator_memory, cuda_allocator, out_of_memory
from dflash.target.spec import is_random_target, target_folder
from dflash.training.accumulate import Walked, accumulate_gradients, shape
from dflash.training.checkpoint import Checkpointer
from dflash.training.config import OPTIONS, TrainConfig, speculate_turns
from dflash.training.data import TrainingData, chat_data, check_data, prepare_token_store
from dflash.training.ds_config import resolve_ds_config
from dflash.training.evaluator import Evaluator
from dflash.training.metrics import MetricsWriter, plot_curves, read_records, tau_at_words, trim_jsonl
from dflash.training.models import Models, load_train_target
from dflash.training.noise import FeatureNoise
from dflash.training.phases import PhaseTimer
from dflash.training.plan import drafter_settings, plan_run, resolve_run, schedule_differences
from dflash.training.step_metrics import StepMetrics, StepResult
from dflash.training.steps import micro_batches
from dflash.training.target import LoadedTarget


def input_paths(cfg: TrainConfig) -> dict[str, Path]:
    """The files every rank reads, by flag (a random target and synthetic data are made in memory)."""
    paths = {"--target": cfg.inputs.target, "--data": cfg.inputs.data,
             "--deepspeed_config": resolve_ds_config(cfg.device.deepspeed_config)}
    made = {"--target": target_folder(cfg.inputs.target) is None, "--data": is_synthetic(cfg.inputs.data)}
    return {flag: Path(path) for flag, path in paths.items() if not made.get(flag)}


def init_drafter_note(folder: Path, spec, identity: dict) -> str | None:
    """What to say when --init-drafter records (`TARGET_KEY`) another target than --target, by content
    (`identity`, `TargetSpec.fingerprint`): its weights start the run all the same (a drafter carried
    to a fine-tune of its target, say), but the user should know."""
    from dflash.drafter.config_format import TARGET_KEY

    record = json.loads((folder / "config.json").read_text()).get(TARGET_KEY)
    if not isinstance(record, dict) or not record.get("sha256") or record["sha256"] == identity.get("sha256"):
        return None
    return (f"--init-drafter {folder}: trained on {record.get('name')}, another model than --target {spec.name} "
            "(by content): its weights start this run all the same")


class Trainer:
    """One training run: the parts, the loop and its state (step, planner position, non-finite count).

    Public parts, for tools that drive runs (compare_modes): `data` (TrainingData), `models`
    (Models), `evaluator` (Evaluator); `train_step()` takes one optimizer step, `evaluate()` runs
    and records the held-out walk.
    """

    def __init__(self, cfg: TrainConfig, target: LoadedTarget | None = None):
        """`cfg`: resolved (`config.load_config` / `config.resolve`). `target`: an already loaded
        target to share (e.g. by several modes in one process); it must match cfg's target
        options. None loads it."""
        from deepspeed.accelerator import get_accelerator

        self.cfg = cfg
        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.output_dir = Path(cfg.run.output_dir)
        self.paths = RunPaths(self.output_dir)
        check_shared_paths(self.output_dir, input_paths(cfg))
        self.accelerator = get_accelerator()
        self.device = torch.device(self.accelerator.current_device_name())
        self._allocator_line = cuda_allocator(os.environ, self.device)  # before anything is allocated

        # everything that can be refused is refused before the target loads: the data's format, the
        # target's config (a family dflash lacks, a config without sizes), the DeepSpeed config, the
        # memory plan (a run that cannot fit; the row budget that fits). The options are resolved here,
        # once (`ResolvedRun`: the target's spec, the drafter kind, --loss's terms); each part takes its piece
        check_data(cfg.inputs, cfg.run)
        plan = plan_run(resolve_run(cfg), device=self.device, world_size=self.world_size)
        self.target_spec = spec = plan.spec
        self.cfg = cfg = plan.cfg
        ds_config, self.dtype, self.memory_plan = plan.ds_config, plan.dtype, plan.memory
        self.drafter_settings = dict(plan.drafter_settings)
        self.run_folder = RunFolder(self.output_dir)
        self.checkpointer = Checkpointer(self.output_dir, cfg.run.keep_checkpoints)
        on_rank0(self._claim, "claiming the run folder")

        features = (cfg.inputs.features, cfg.inputs.data) if cfg.inputs.features else None
        target = target or load_train_target(spec, self.device, self.dtype, cfg.drafter, cfg.device,
                                             chat_data(cfg.inputs), features)
        # what the drafter was trained with, as values: the mask token's id (the drafter's with
        # --init-drafter, else the one the tokenizer gives --mask-token) and the embedding's rows
        self.drafter_settings.update({"mask token id": target.mask_id,
                                      "embedding rows": target.model.num_embedding_rows})
        if cfg.run.resume:  # every rank: the checkpoint's record is read on rank 0
            on_rank0(lambda: self.checkpointer.refuse_another_drafter(self.drafter_settings, self.run_folder),
                     "comparing the checkpoint's drafter with this run's")
        self.data = TrainingData(cfg.inputs, cfg.batches, plan.data,
                                 prepare_token_store(cfg.inputs, cfg.run, target.tokenizer, self._say),
                                 tokenizer=target.tokenizer, target_spec=spec,
                                 target_layer_ids=target.model.target_layer_ids,
                                 vocab_rows=target.model.num_embedding_rows, mask_token_id=target.mask_id,
                                 world_size=self.world_size)
        self.models = Models(plan.models, cfg.loss, cfg.optim, target, ds_config, total_steps=self.data.total_steps,
                             device=self.device)
        self.evaluator = Evaluator(cfg.eval, plan.evaluation, self.data, self.models, self.device, self.dtype,
                                   say=self._say)
        self.phases = PhaseTimer(self.device, self.models.drafter) if cfg.run.time_phases else None
        self.noise = FeatureNoise(cfg.loss.feature_noise, cfg.run.seed) if cfg.loss.feature_noise else None
        self.step_metrics = StepMetrics(self.device, self.world_size, self.rank, self.models.loss.figures, self.phases)

        self.step = 0
        self.micro_batch_shapes: list[tuple[int, int, int]] = []  # of the last step, this rank's
        self.nonfinite_in_row = self.nonfinite_total = 0
        d = self.data
        self._say(f"dflash: {self.world_size} rank(s) on {self.device.type}, {self.dtype}, "
                  f"ZeRO-{self.models.zero_stage}; {len(d.train_idx):,} train / {len(d.eval_idx):,} eval samples "
                  f"({len(d.store) - d.usable:,} too short for a block); {cfg.batches.order}-{cfg.batches.layout}, "
                  f"budget {cfg.batches.token_budget:,}; {d.total_steps} steps of {self._step_content()}; "
                  + ("micro-batches dealt to the ranks by cost (--balance: ranks wait less for each other)"
                     if d.balance else "round robin to the ranks (--no-balance)" if self.world_size > 1
                     else "one rank: no dealing"))
        self.target_bytes = target_bytes(target.model)
        self._say(target_summary(self.target_bytes, self.world_size, features=cfg.inputs.features,
                                 partition=cfg.device.target_partition, offload=cfg.device.target_offload,
                                 decodes=bool(cfg.eval.speculate_turns)))
        self._say(plan.memory_line)
        if self._allocator_line:
            self._say(self._allocator_line)
        if cfg.run.resume:
            self._resume()
        if self.rank == 0:  # only now: a refused resume leaves the run's config as it was
            write_json(self.paths.config, cfg.options())
        # A resumed run's logs end at its checkpoint (step 0 without one): what the stopped attempt
        # wrote after it is redone, so no record is there twice.
        self.metrics = MetricsWriter(self.output_dir, enabled=self.rank == 0,
                                     resume_step=self.step if cfg.run.resume else None)
        if cfg.run.resume and cfg.run.sample_log:
            trim_jsonl(self._sample_log_path(), self.step)
        self._stream = self._micro_steps()

    def _step_content(self) -> str:
        """What a step holds, from the plan: micro-batches and real tokens per rank, on average (a step
        ends with the micro-batch that reaches --step-tokens, so it holds more than that)."""
        d = self.data
        micro = [end - first for ranges in d.steps for first, end in ranges][:d.total_steps]
        tokens = d.step_tokens()
        return (f"{sum(micro) / max(len(micro), 1):.1f} micro-batches and "
                f"{sum(tokens) / max(len(tokens), 1) / self.world_size:,.0f} real tokens per rank on average "
                f"(--step-tokens {self.cfg.batches.step_tokens:,}: a step ends with the micro-batch that reaches it)")

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def _claim(self) -> None:
        """Rank 0: lock the run folder and, for --resume, refuse options that would train another
        drafter than the checkpoint's, before anything loads."""
        cfg = self.cfg
        reads = {**input_paths(cfg), "--init-drafter": cfg.drafter.init_drafter, "--features": cfg.inputs.features}
        check_apart(self.run_folder.path, reads, "--output-dir")  # before the target's files are hashed

        def settings_of(options: dict) -> dict:  # a checkpoint of an older dflash: its options, the target by path
            old = cfg.replace(**{k: v for k, v in options.items() if k in OPTIONS})
            target = old.inputs.target
            return {**drafter_settings(resolve_run(old, self.target_spec), self.target_spec.num_layers),
                    "--target": {"path": target if is_random_target(target) else str(Path(target).resolve())}}

        # the target by content: the checkpoint's record spares hashing the files unchanged since
        recorded = ((self.checkpointer.newest_state() or {}).get("drafter") or {}).get("--target") \
            if cfg.run.resume else None
        self.drafter_settings["--target"] = self.target_spec.fingerprint(known=recorded)
        if cfg.drafter.init_drafter and not cfg.run.resume:
            note = init_drafter_note(Path(cfg.drafter.init_drafter), self.target_spec,
                                     self.drafter_settings["--target"])
            if note:
                self._say(note)
        self.checkpointer.claim(self.run_folder, resume=cfg.run.resume, overwrite=cfg.run.overwrite, reads=reads,
                                settings=self.drafter_settings, settings_of=settings_of)
        diffs = schedule_differences(self.checkpointer.recorded_options, cfg) if cfg.run.resume else []
        if diffs and not cfg.run.force_resume:
            self.run_folder.release()
            raise UserError(f"--resume: {self.checkpointer.recorded[0]} was trained with another schedule:\n  "
                            + "\n  ".join(diffs) + "\nresume with the checkpoint's values, or add --force-resume to "
                            "continue with these (the run then equals neither schedule)")

    def _target_record(self) -> dict | None:
        """Rank 0: what the exported drafter records of its target (`TARGET_KEY`): the name as given,
        the family, the depth and the content hash (`dflash.identity`; a `random:` target has none)."""
        if self.rank != 0:
            return None
        spec, identity = self.target_spec, self.drafter_settings["--target"]
        return {"name": spec.name, "path": identity["path"], "model_type": spec.family,
                "num_hidden_layers": spec.num_layers, "sha256": identity.get("sha256")}

    def state_dict(self) -> dict:
        """The run's state beside the engine's: what a checkpoint records to continue it."""
        return {"step": self.step, "planner": self.data.planner.state_dict(),
                "step_tokens": self.cfg.batches.step_tokens, "world_size": self.world_size,
                "nonfinite_steps": self.nonfinite_total, "config": self.cfg.options(),
                "drafter": self.drafter_settings,
                "torch_rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}

    def _differences(self, state: dict) -> list[str]:
        """What changed since the checkpoint of `state`: the planner's settings and data (its state
        is loaded, as --force-resume continues with it) and the step size."""
        diffs = self.data.planner.load_state_dict(state["planner"], force=True)
        if state["step_tokens"] != self.cfg.batches.step_tokens:
            diffs.append(f"step_tokens: checkpoint {state['step_tokens']} -> now {self.cfg.batches.step_tokens}")
        return diffs

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's run state (its engine state loaded): the step, the non-finite
        count, the RNG; with another world size the schedule is stepped to the step and the planner's
        position rescaled; after a forced resume the planner moves to the next step of the new plan."""
        planner = self.data.planner
        self.step = int(state["step"])
        self.nonfinite_total = int(state.get("nonfinite_steps", 0))
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch_rng"])), dtype=torch.uint8))
        if state["world_size"] != self.world_size:
            self._say(f"--force-resume: {state['world_size']} -> {self.world_size} ranks: the weights are loaded, "
                      "the optimizer state (AdamW moments) starts fresh")
            for _ in range(self.step):
                self.models.scheduler.step()
            planner.position = planner.position * state["world_size"] // self.world_size
        epoch = planner.epoch
        position = planner.to_step_boundary(self.data.steps)  # moves only after a forced resume
        if position is not None:
            self._say(f"--force-resume: epoch {epoch} continues at micro-step {planner.position} of the new plan "
                      f"(was {position}); samples of this epoch may be repeated or skipped")

    def _resume(self) -> bool:
        """Load the newest complete checkpoint; False when there is none."""
        resumed = self.checkpointer.resume(self.models.engine, differences=self._differences,
                                           world_size=self.world_size, force=self.cfg.run.force_resume)
        if resumed is None:
            self._say(f"--resume: no complete checkpoint in {self.checkpointer.root}; starting from the beginning "
                      "(the records of the attempt before are removed)")
            return False
        state, diffs = resumed
        for d in diffs:
            self._say(f"--force-resume: {d}")
        self.load_state_dict(state)
        planner = self.data.planner
        self._say(f"resumed from {state['checkpoint']} at step {self.step} (epoch {planner.epoch}, "
                  f"micro-step {planner.position})")
        return True

    # ---- the loop ------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.step >= self.data.total_steps or self.data.planner.epoch >= self.cfg.optim.epochs

    def _micro_steps(self):
        """This rank's micro-batches, one optimizer step's worth at a time, from where the
        planner stands (0 for a fresh run, the checkpoint's micro-step after a resume)."""
        planner = self.data.planner
        while not self.done:
            epoch = planner.epoch
            ranges = [r for r in self.data.steps[epoch] if r[0] >= planner.position]
            assert ranges and ranges[0][0] == planner.position, "_resume leaves the planner on a step boundary"
            loader = micro_batches(self.data.maker, self.data.batches(epoch, self.rank), epoch, planner.position,
                                   num_workers=self.cfg.batches.num_workers, pin_memory=self.device.type == "cuda")
            for first, end in ranges:
                if self.step >= self.data.total_steps:
                    return
                yield epoch, first, [next(loader) for _ in range(end - first)]

    def close(self) -> None:
        """Free what the run holds when it stops without `train()` (a benchmark done with a mode): the
        loader, the metrics files, the phase hooks, the DeepSpeed engine's buffers, the folder's lock."""
        self._stream.close()
        self.metrics.close()
        if self.phases:
            self.phases.close()
        self.models.engine.destroy()
        self.run_folder.release()

    def skip_to_epoch(self, epoch: int) -> None:
        """Continue at the first step of `epoch` (benchmarks: a warm-up cut short, then whole epochs)."""
        self._stream.close()
        self.data.planner.epoch, self.data.planner.position = epoch, 0
        self._stream = self._micro_steps()

    def train(self) -> dict:
        from tqdm.auto import tqdm

        cfg, total = self.cfg, self.data.total_steps
        bar = tqdm(total=total, initial=self.step, desc="train", unit="step",
                   disable=self.rank != 0 or not cfg.run.progress, dynamic_ncols=True)
        last_eval = None
        try:
            while not self.done:
                epoch = self.data.planner.epoch
                record = self.train_step()
                bar.update(1)
                if self.nonfinite_in_row >= cfg.run.max_nonfinite_steps:
                    self._stop_after_nonfinite_steps()
                epoch_done = self.data.planner.epoch != epoch  # advance() rolled over
                last = self.step >= total
                if record is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}", anchor_tau=f"{record['anchor_tau']:.2f}",
                                    tok_s=f"{record['tokens_per_s']:.0f}")
                every = cfg.eval.eval_every
                # a periodic evaluation less than half an interval before the end is the end's own (the
                # demo's 106 steps, every 21: not at 105 and again at 106)
                periodic = every and self.step % every == 0 and total - self.step >= every / 2
                if periodic or (not every and epoch_done) or last:
                    last_eval = self.evaluate()
                stop = self.step == cfg.run.stop_at_step
                if (cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0) or \
                        (not cfg.run.checkpoint_every and epoch_done) or last or stop:
                    self.save_checkpoint()
                if stop:
                    self._say(f"--stop-at-step {self.step}: stopped; continue with --resume")
                    return {"step": self.step, "eval": last_eval, "stopped": True}
        finally:  # also on --stop-at-step and errors: TensorBoard keeps its tail
            bar.close()
            self._stream.close()
            self.metrics.close()
        result = {"step": self.step, "eval": last_eval}
        drafter_dir = self.paths.drafter
        if cfg.run.export:
            try:
                self.models.export(drafter_dir, self._target_record())
            except DiskFull as err:
                raise UserError(f"{err}; the last checkpoint holds the weights: free some space and run the same "
                                "command with --resume to export them") from None
            self._say(f"exported the drafter to {drafter_dir}")
        if self.rank == 0 and self.metrics.path.is_file():
            plot_curves(read_records(self.output_dir), self.paths.curves, str(self.output_dir))
            self._say(f"loss and tau curves: {self.paths.curves}")
        turns = speculate_turns(cfg, self.data.total_steps)
        # a partitioned target cannot decode on one rank alone (its layers are gathered collectively)
        whole = cfg.device.target_partition == "none"
        if cfg.run.export and turns and self.data.eval_idx.size and self.rank == 0 and whole:
            result["speculate"] = self.evaluator.speculate_heldout(drafter_dir, self.step,
                                                                   self.paths.speculate, turns)
        if cfg.run.export:
            k = cfg.drafter.block_size - 1
            self._say(f"serve it (README, Serve your drafter): vLLM --speculative-config '{{\"method\": \"dflash\", "
                      f"\"model\": \"{drafter_dir}\", \"num_speculative_tokens\": {k}}}'; served as trained? "
                      f"python launch/speculate.py --drafter {drafter_dir} --engine vllm")
        self.run_folder.release()
        return result

    def train_step(self) -> dict | None:
        """One optimizer step over this rank's next micro-batches; the loss is normalised by the
        loss weight of the WHOLE step (all micro-batches, all ranks), so the gradient is that of
        one big batch. Returns the step's metrics (the same on every rank) on logged steps."""
        cfg, engine, t0 = self.cfg, self.models.engine, time.perf_counter()
        if self.phases:
            self.phases.start()
        epoch, first, micro = next(self._stream)  # waiting for data is part of the step
        # this rank's micro-batches, as the memory plan prices them
        self.micro_batch_shapes = [shape(m, cfg.drafter.block_size) for m in micro]
        timings = [] if cfg.run.time_micro_batches else None
        walked = Walked(micro)
        try:
            accumulated = accumulate_gradients(engine, self.models.target.model, self.models.loss, walked, self.device,
                                               cfg.drafter.block_size, timings, self.phases, noise=self.noise,
                                               epoch=epoch)
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            if not allocation_failed(err):
                raise
            raise self._out_of_memory(shape(walked.current, cfg.drafter.block_size)) from None
        busy = waited = float("nan")
        if self.step % cfg.run.log_every == 0 or self.step + 1 >= self.data.total_steps:
            # A step that will be logged: the ranks meet before the step's collectives, and time spent
            # in this barrier is time spent waiting for the slowest rank (busy: everything before it;
            # under ZeRO-3, or ZeRO-2 with overlap_comm, ranks also meet inside each backward, and
            # that wait counts as busy). Other steps skip the host sync.
            self.accelerator.synchronize()
            busy = time.perf_counter() - t0
            dist.barrier()
            waited = time.perf_counter() - t0 - busy
        if self.phases:
            self.phases.mark("other")
        try:
            engine.step()
        except RuntimeError as err:
            if not allocation_failed(err):
                raise
            raise self._out_of_memory(None) from None
        if self.phases:
            self.phases.mark("optimizer")
        # The ZeRO optimizers skip the update when the global gradient norm is not finite.
        applied = engine.was_step_applied()
        self.nonfinite_in_row = 0 if applied else self.nonfinite_in_row + 1
        self.nonfinite_total += not applied
        if not applied:
            self._say(f"step {self.step + 1}: non-finite loss or gradients, update skipped "
                      f"({self.nonfinite_in_row} in a row, {self.nonfinite_total} in all)")
        if cfg.run.sample_log:
            self._log_samples(micro, epoch, first)
        self.data.planner.advance(len(micro))
        self.step += 1
        if applied and (self.step - 1) % cfg.run.log_every and self.step < self.data.total_steps:
            return None
        grad_norm = self.models.engine.get_global_grad_norm()
        record = self.step_metrics.record(StepResult(accumulated, epoch, micro, t0, busy, waited, applied, timings),
                                          target_memory=target_bytes(self.models.target.model),
                                          lr=self.models.scheduler.get_last_lr()[0], grad_norm=grad_norm,
                                          nonfinite_steps=self.nonfinite_total)
        self.metrics.write("train", self.step, record)
        return record

    def _out_of_memory(self, micro_batch_shape) -> UserError:
        """A step ran out of memory: stop in one line (the checkpoints on disk stay as they are)."""
        complete = self.checkpointer.complete()
        return UserError(out_of_memory(self.memory_plan, accelerator_memory(self.device, self.cfg.device.memory_gib),
                                       step=self.step + 1, shape=micro_batch_shape,
                                       row_budget=self.cfg.batches.row_budget,
                                       token_budget=self.cfg.batches.token_budget,
                                       checkpoint=str(complete[-1]) if complete else None))

    def _stop_after_nonfinite_steps(self) -> None:
        first = self.step - self.nonfinite_in_row + 1
        # skipped updates left the weights and optimizer as they were after step first - 1
        path = self.save_checkpoint()
        raise UserError(
            f"steps {first}-{self.step}: {self.nonfinite_in_row} optimizer steps in a row had non-finite loss or "
            f"gradients and were skipped (--max-nonfinite-steps {self.cfg.run.max_nonfinite_steps}); stopped with a "
            f"checkpoint of the last good weights in {path}. Likely causes: a learning rate too high (--lr), "
            "bf16 overflow (--dtype fp32), or bad samples (--sample-log writes which samples each step used). "
            "--resume continues after these steps.")

    def _sample_log_path(self) -> Path:
        return self.paths.samples(self.rank)

    def _log_samples(self, micro, epoch: int, first: int) -> None:
        with open(self._sample_log_path(), "a") as f:
            f.write(json.dumps({"step": self.step + 1, "epoch": epoch, "micro_step": first,
                                "samples": [m.batch.sample_ids.tolist() for m in micro]}) + "\n")

    def evaluate(self) -> dict | None:
        """The held-out walk (collective), recorded in the metrics and said."""
        record = self.evaluator.walk()
        if record is None:
            return None
        self.metrics.write("eval", self.step, record)
        note = self.evaluator.temperature_note()
        if note:
            self._say(note)
        sampled = "".join(f", {part}" for part in tau_at_words(record))
        sampled += self.models.eval_loss.words(record)  # what the loss terms add (a kind's own figures)
        self._say(f"eval @ step {self.step}: loss {record['loss']:.4f}, tau {record['tau']:.3f} (decoding walk: "
                  f"{record['tokens']:,} tokens in {record['blocks']:,} blocks, {record['turns']} turns){sampled}, "
                  f"anchor_tau {record['anchor_tau']:.3f}")
        return record

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.models.engine, self.state_dict())
