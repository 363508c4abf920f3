"""Training end to end with real DeepSpeed CPU ranks (gloo), plus its small components."""
import json
import math

import numpy as np
import pytest
from safetensors.torch import load_file

from dflash.demo import DATA as DEMO_DATA
from dflash.demo import TARGET as DEMO_TARGET
from dflash.errors import UserError
from dflash.training.config import load_config, resolve
from dflash.training.ds_config import load_ds_config
from dflash.training.metrics import MetricsWriter
from dflash.training.models import lr_lambda
from dflash.training.steps import step_ranges

from .. import preloaded
from ..conftest import ROOT
from ..runs import TURN_LIMIT, make_family_target, read_metrics, run_deepspeed, tiny_train_args, with_turn_limit


def test_step_ranges_cover_every_micro_step_with_the_token_target():
    lengths = np.array([100, 300, 50, 500, 200, 400, 100, 100])
    plan = [[np.array([0]), np.array([1, 2]), np.array([3]), np.array([4])],
            [np.array([5]), np.array([6]), np.array([7]), np.array([2])]]
    # average tokens per micro-step over the two ranks: 250, 225, 300, 125
    assert step_ranges(plan, lengths, 450) == [(0, 2), (2, 4)]
    assert step_ranges(plan, lengths, 10_000) == [(0, 4)]
    assert step_ranges(plan, lengths, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_schedule_warms_up_linearly_then_follows_a_cosine():
    f = lr_lambda("cosine", warmup=4, total=20)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and math.isclose(f(12), 0.5) and f(20) == 0.0


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_shipped_deepspeed_configs_are_filled(name):
    config = load_ds_config(ROOT / "ds_configs" / f"{name}.json", world_size=4, grad_clip=1.0, bf16=True)
    assert config["train_micro_batch_size_per_gpu"] == 1 and config["gradient_accumulation_steps"] == 1
    assert config["train_batch_size"] == 4 and config["managed_gradient_accumulation"] is False
    assert config["gradient_clipping"] == 1.0 and config["bf16"]["enabled"] is True
    assert "auto" not in json.dumps(config)


def test_deepspeed_config_that_fights_the_trainer_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}))
    with pytest.raises(UserError, match="'train_micro_batch_size_per_gpu' is 8"):
        load_ds_config(path, world_size=1, grad_clip=1.0, bf16=False)


@pytest.fixture(scope="module")
def grad_equality(tiny_run_inputs, tiny_store):
    """One two-rank launch that checks ZeRO-2 and ZeRO-3 in turn (a launch costs far more than a step)."""
    target, _ = tiny_run_inputs
    return run_deepspeed([str(target), str(tiny_store), "2,3"], script=ROOT / "tests" / "training" /
                         "grad_equality_script.py")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_with_uneven_micro_batches_give_the_gradient_of_one_batch(grad_equality, stage):
    proc = grad_equality
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = float(proc.stdout.split(f"GRAD_MAX_ERR[{stage}]=")[1].split()[0])
    assert err < 1e-5


def check_official_export(drafter_dir):
    """The exported drafter in the official format: its config is a Qwen3 config (the official
    DFlashDraftModel's base class), its tensors the official set, each layer's loading strictly
    into a Qwen3 decoder layer built from that config."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from dflash.drafter.config_format import TARGET_KEY
    from dflash.models import CONFIG_KEYS, DFlashDrafter

    from ..drafter.checkpoint_helpers import expected_names

    exported = json.loads((drafter_dir / "config.json").read_text())
    assert set(exported) - {"is_causal", TARGET_KEY} == CONFIG_KEYS
    assert exported["architectures"] == ["DFlashDraftModel"]
    assert set(exported[TARGET_KEY]) == {"name", "path", "model_type", "num_hidden_layers", "sha256"}
    tensors = load_file(drafter_dir / "model.safetensors")
    assert set(tensors) == expected_names(exported["num_hidden_layers"])
    config = Qwen3Config.from_pretrained(drafter_dir)
    for i in range(config.num_hidden_layers):
        prefix = f"layers.{i}."
        Qwen3DecoderLayer(config, i).load_state_dict({k[len(prefix):]: v for k, v in tensors.items()
                                                      if k.startswith(prefix)}, strict=True)
    assert DFlashDrafter.from_pretrained(drafter_dir).config.target_layer_ids == \
        exported["dflash_config"]["target_layer_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("config,layout,order,family,partition", [
    # the dense control, and the target families of issue 25 in the other launches: MoE padded, hybrid
    # Gated DeltaNet + MoE packed (decoding too: its recurrent state rolled back), hybrid padded with
    # the target partitioned across the ranks (issue 26)
    ("zero2", "packed", "shuffle", "qwen3", "none"), ("zero2", "padded", "sorted", "qwen3_moe", "none"),
    ("zero3", "packed", "bucketed", "qwen3_5_moe_text", "none"),
    ("zero3", "padded", "shuffle", "qwen3_5_text", "zero3"),
])
def test_train_runs_on_two_ranks(tiny_run_inputs, tmp_path, config, layout, order, family, partition):
    target, data = tiny_run_inputs
    if family != "qwen3":
        target = make_family_target(tmp_path / "target", family)
    data = with_turn_limit(data, tmp_path / "data.jsonl")  # sampled and decoded turns stop at TURN_LIMIT
    out = tmp_path / "run"
    # the default rule (-1): one held-out turn per optimizer step, so the dense 3-step run decodes 3 (of 6); the
    # hybrid one decodes one (its recurrent state rolled back; ~55 ms a target forward in eager PyTorch here)
    decode = {"qwen3": ["--speculate-turns", -1], "qwen3_5_moe_text": ["--speculate-turns", 1]}.get(family, [])
    proc = run_deepspeed(tiny_train_args(target, data, out, "--max-steps", 3, "--layout", layout, "--order", order,
                                         "--deepspeed_config", f"ds_configs/{config}.json", *decode,
                                         "--target-partition", partition))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = read_metrics(out)
    assert [r["step"] for r in train] == [1, 2, 3]
    # the target's bytes per rank: all of it, or half (and a few norms) when partitioned over the two ranks
    full = sum(t.numel() * 4 for t in load_file(target / "model.safetensors").values())
    share = [b / full for b in train[-1]["target_resident_bytes"]]
    assert share == [1.0, 1.0] if partition == "none" else all(0.5 <= s < 0.52 for s in share), share
    assert "micro-batches dealt to the ranks by cost (--balance" in proc.stdout
    assert all(math.isfinite(r["loss"]) and r["real_tokens"] > 0 and r["anchor_tau"] >= 1 for r in train)
    assert all((r["efficiency"] == 1.0) == (layout == "packed") for r in train)
    final = read_metrics(out, "eval")[-1]  # evaluated at the end
    # the walk covers every held-out turn (6 samples of one turn each), split over both ranks
    assert final["turns"] == 6 and final["tau"] >= 1 and final["anchor_tau"] >= 1
    # --eval-temperatures 0,1 (default): tau@0 is the greedy walk, tau@1 an expected acceptance length
    # along the 6 held-out prompts continued by the target at 1 (3 on each rank, kept for the run); a
    # partitioned target does not generate: tau@1 follows the data's turns
    assert final["tau@0"] == final["tau"] and 1 <= final["tau@1"] <= 16
    if partition == "none":
        assert final["tau@1_stderr"] > 0
        sampled = json.loads((out / "eval_turns.json").read_text())
        assert sampled["fingerprint"]["turns"] == 6 and len(sampled["turns"]["1"]) == 6
        assert "eval: sampling 6 held-out turns at temperature 1" in proc.stdout
    else:
        assert not (out / "eval_turns.json").exists() and "tau@1 follow them" in proc.stdout
    assert (out / "speculate.json").is_file() == bool(decode)
    if decode:
        figure = json.loads((out / "speculate.json").read_text())
        turns = 3 if family == "qwen3" else 1
        assert figure["turns"] == turns and figure["acceptance_length"] >= 1 and figure["lossless"] is None
        assert figure["max_new_tokens"] == TURN_LIMIT and figure["tokens"] <= turns * TURN_LIMIT
        assert f"speculative decoding of {turns} held-out turn{'s' * (turns > 1)}: acceptance length" in proc.stdout
    exported = json.loads((out / "drafter" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"] and exported["num_hidden_layers"] == 1
    check_official_export(out / "drafter")


@pytest.mark.slow
def test_block_size_larger_than_any_sample_is_a_clear_error(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    proc = run_deepspeed(tiny_train_args(target, data, tmp_path / "run", "--block-size", 200, "--gamma", 7),
                         num_ranks=1)
    assert proc.returncode != 0
    assert "--block-size 200: a sample needs at least 400 supervised tokens" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


BAD_OPTIONS = [
    (["--order", "random"], "--order: must be one of sorted, shuffle, bucketed, got 'random'"),
    (["--token-budget", "0"], "--token-budget: must be >= 1, got 0"),
    (["--block-size", "12"], "--gamma: no default for block size 12; give --gamma"),
    (["--force-resume"], "--force-resume: only makes sense with --resume"),
    (["--config", "nope.yaml"], "--config nope.yaml: no such file"),
    (["--lr", "inf"], "--lr: must be a finite number, got inf"),
    (["--lr", "nan"], "--lr: must be a finite number, got nan"),
    (["--weight-decay", "nan"], "--weight-decay: must be a finite number, got nan"),
    (["--seed", "-1"], "--seed: must be >= 0, got -1"),
    (["--attention-backend", "cudnn"], "--attention-backend: must be one of auto, triton, torch, flex, torch_varlen, "
                                       "flash_attn, got 'cudnn'"),
    (["--grad-clip", "-1"], "--grad-clip: must be >= 0 (0: no clipping), got -1.0"),
    (["--gamma", "-2"], "--gamma: must be positive (0: the default for the block size), got -2.0"),
    (["--target-layer-ids", "1,3,1"], "--target-layer-ids: values must not repeat, got '1,3,1'"),
    (["--target-layer-ids", "1,x"], "--target-layer-ids: 'x' is not an integer (expected a comma-separated list, "
                                    "got '1,x')"),
    (["--boundaries", "900,300"], "--boundaries: values must be strictly increasing, got '900,300'"),
    (["--eval-temperatures", "0,-1"], "--eval-temperatures: values must be >= 0, got '0,-1'"),
    (["--eval-temperatures", "1,inf"], "--eval-temperatures: must be finite numbers >= 0, got (1.0, inf)"),
    (["--row-budget", "100"], "--row-budget: must be 0 or at least block size x anchors (1024) so that every sample "
                              "fits, got 100"),
    (["--target-partition", "zero2"], "--target-partition: must be one of none, zero3, got 'zero2'"),
    (["--target-offload"], "--target-offload: offloads the partitions of --target-partition zero3; add it, or drop "
                           "--target-offload"),
    (["--memory-gib", "-1"], "--memory-gib: must be in [0, 65536] GiB (0: the GPU's own), got -1.0"),
    (["--drafter-layer-types", "sliding,dense"], "--drafter-layer-types: 'dense' is not sliding or full (expected a "
                                                 "comma-separated list, got 'sliding,dense')"),
    (["--drafter-layer-types", "sliding,full,full"], "--drafter-layer-types: gives 3 types for 2 drafter layers "
                                                     "(--draft-layers): one per layer"),
    (["--drafter-layer-types", "sliding,full"], "--sliding-window: sliding drafter layers need a window >= 1 "
                                                "(positions seen, the query's own included)"),
    (["--sliding-window", "8"], "--sliding-window: no drafter layer is sliding (--drafter-layer-types)"),
    (["--selector-stop-grad"], "--selector-stop-grad: applies to a DFlash2 drafter: give --drafter-kind "
                               "dflash2 (or --init-drafter a DFlash2 drafter)"),
    (["--init-drafter", "nope"], "--init-drafter nope: no config.json (a drafter folder in the official format "
                                 "holds config.json and model.safetensors)"),
    (["--balance", "--cost-model", "nope.json"], "--cost-model: nope.json: not a cost model JSON of per_token, "
     "per_pair, per_row, per_row_key, per_sample, per_batch, per_window_pair, unit, window ([Errno 2] No such file or "
     "directory: 'nope.json')"),
]


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[m.split(":")[0] for _, m in BAD_OPTIONS])
def test_bad_options_name_the_flag(argv, message):
    with pytest.raises(UserError) as err:
        load_config(argv)
    assert str(err.value) == message


def test_the_end_of_run_decode_scales_with_the_run():
    from dflash.training.config import speculate_turns

    default = load_config([])
    assert [speculate_turns(default, steps) for steps in (4, 100, 5000)] == [4, 100, 100]
    assert speculate_turns(load_config(["--speculate-turns", "7"]), 4) == 7, "an explicit number is kept"
    assert speculate_turns(load_config(["--speculate-turns", "0"]), 5000) == 0, "0 skips it"
    with pytest.raises(UserError, match=r"--speculate-turns: must be >= 0, or -1 \(one per optimizer step\)"):
        load_config(["--speculate-turns", "-2"])


def test_config_file_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\nlearning_rate: 2e-3\n")
    with pytest.raises(UserError, match=rf"--config {path}: unknown key 'learning_rate'"):
        load_config(["--config", str(path)])
    path.write_text("lr: [1e-3\n")
    with pytest.raises(UserError, match=rf"--config {path}: not valid YAML"):
        load_config(["--config", str(path)])
    path.write_text("lr: 1e-3\nepochs: 2\n")
    assert load_config(["--config", str(path), "--epochs", "3"]).optim.epochs == 3, "flags override the file"


def test_options_are_resolved_once_into_typed_values():
    demo = load_config([])
    assert (demo.inputs.target, demo.inputs.data) == (str(DEMO_TARGET), str(DEMO_DATA)), "the demo preset's paths"
    assert (demo.batches.step_tokens, demo.inputs.max_length, demo.loss.gamma) == (2048, 1024, 7.0)
    c = load_config(["--data", "d.jsonl", "--token-budget", "2048", "--block-size", "8", "--boundaries", "300,900"])
    assert c.inputs.target == str(DEMO_TARGET) and c.run.output_dir == "runs/demo", "no preset once --data is given"
    assert (c.batches.step_tokens, c.inputs.max_length, c.loss.gamma, c.batches.boundaries) == \
        (4 * 2048, 2048, 4.0, (300, 900))
    assert load_config(["--data", "d", "--gamma", "3", "--step-tokens", "5"]).loss.gamma == 3.0
    assert resolve(c) == c, "resolving twice changes nothing"


def test_every_command_parses_lists_alike(tmp_path):
    """train.py and plan_batches.py share one list parser: same values, same errors."""
    np.save(tmp_path / "lengths.npy", np.array([100, 200, 300, 400] * 50))
    argv = ["--lengths", str(tmp_path / "lengths.npy"), "--token-budget", "1024", "--json"]
    script = ROOT / "launch" / "plan_batches.py"
    ok = preloaded.run(script, [*argv, "--boundaries", "150,250"])
    assert ok.returncode == 0 and json.loads(ok.stdout)["buckets"]["boundaries"] == [0, 150, 250, 400]
    bad = preloaded.run(script, [*argv, "--boundaries", "250,150"])
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --boundaries: values must be strictly increasing, " \
        "got '250,150'"
    assert load_config(["--data", "d", "--boundaries", "150,250"]).batches.boundaries == (150, 250)


def test_config_file_values_are_read_as_the_option_types(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\nepochs: 2.0\ntarget_layer_ids: [1, 3]\nsample_log: true\n")
    config = load_config(["--config", str(path)])
    assert (config.optim.lr, config.optim.epochs, config.drafter.target_layer_ids, config.run.sample_log) == \
        (1e-3, 2, (1, 3), True)
    path.write_text("epochs: two\n")
    with pytest.raises(UserError, match=rf"--config {path}: 'epochs' must be an integer, got 'two'"):
        load_config(["--config", str(path)])


def test_metrics_are_cut_back_to_the_resumed_step_and_plotted(tmp_path):
    from dflash.training.metrics import plot_curves, read_records, sampled_tau_keys, tau_at_words, training_seconds

    writer = MetricsWriter(tmp_path, enabled=True)
    for step in (1, 2, 3):
        writer.write("train", step, {"loss": 3.0 / step, "anchor_tau": 1.0 + step / 10, "step_seconds": 1.5 * step})
    writer.write("eval", 2, {"loss": 2.5, "tau": 1.1, "tau@0": 1.1, "tau@0.7": 1.08, "tau@0.7_stderr": None,
                             "tau@1": 1.05, "tau@1_stderr": 0.02})
    writer.write("train", 4, {"loss": float("nan"), "anchor_tau": 1.0})  # a skipped step: strict JSON null
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # a crash in the middle of a line
    MetricsWriter(tmp_path, enabled=True, resume_step=2).close()
    records = read_records(tmp_path)
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("eval", 2)]
    plot_curves(records + [{"kind": "train", "step": 3, "loss": None, "anchor_tau": None}], tmp_path / "c.png", "t")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert training_seconds(records) == {1: 1.5, 2: 4.5}  # the cut step's seconds are gone with it
    plot_curves(records, tmp_path / "s.png", "t", x="seconds")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert sampled_tau_keys(records) == ["tau@0.7", "tau@1"]  # a curve each (with error bars), beside tau
    assert tau_at_words(records[-1]) == ["tau@0.7 1.080", "tau@1 1.050 +- 0.020"]


def test_non_finite_metric_values_are_written_as_null(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write("train", 1, {"loss": float("nan"), "grad_norm": float("inf"), "tau": 1.5})
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "kind": "train", "step": 1, "loss": None, "grad_norm": None, "tau": 1.5}


def test_the_header_says_what_a_step_holds_and_the_end_is_evaluated_once(tiny_run_inputs, tmp_path, capsys):
    """A step ends with the micro-batch that reaches --step-tokens: the header states what steps hold
    on average, from the plan. --eval-every 3 over 7 steps: at 3 and at the end, not at 6 and again at 7
    (the demo's 105 and 106)."""
    from dflash.testing import train_in_process

    target, data = tiny_run_inputs
    out = tmp_path / "run"
    train_in_process(tiny_train_args(target, data, out, "--max-steps", 7, "--eval-every", 3, "--no-export",
                                     "--eval-temperatures", "0", "--eval-sample-turns", 0))
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dflash: "))
    train = read_metrics(out)
    micro = sum(r["micro_batches"] for r in train) / len(train)
    tokens = sum(r["real_tokens"] for r in train) / len(train)
    assert f"; 7 steps of {micro:.1f} micro-batches and {tokens:,.0f} real tokens per rank on average " \
           "(--step-tokens 1,500: a step ends with the micro-batch that reaches it)" in header, header
    assert [r["step"] for r in read_metrics(out, "eval")] == [3, 7]
