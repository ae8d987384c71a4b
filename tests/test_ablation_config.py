"""Typed ablation and fine-tuning configs (pretrain/evaluation/configs.py) and the fine-tuning protocol: a learning
rate chosen on a part of train held out (never dev), then re-trained on all of train and scored on dev, with the
median over seeds beside mean and std."""

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import TASK_WORDS as WORDS
from helpers import make_task

from pretrain.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "ablation-tiny.yaml")


def tiny_model(directory: Path) -> Path:
    """A random BERT of 1 layer x 16, with a word-level vocabulary: a real HF directory, seconds to probe."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    directory.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "dev", "train", *WORDS]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(str(directory))
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    BertForMaskedLM(config).save_pretrained(str(directory))
    return directory


# ---------------------------------------------------------------------------------------------- typed configs


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.mdoe=full", r"ablation-tiny\.yaml: unknown config key 'eval\.mdoe' \(did you mean 'mode'\?\)"),
        ("launch.schedular=slurm", r"unknown config key 'launch\.schedular' \(did you mean 'scheduler'\?\)"),
        ("budget.kind=flop", r"budget\.kind: value 'flop' is not one of tokens, flops, time \(did you mean 'flops'"),
        ("eval.pooling=mena", r"eval\.pooling: value 'mena' is not one of mean, cls \(did you mean 'mean'"),
        ("eval.seeds=[1, x]", r"eval\.seeds\[1\]: value 'x' is not a valid int"),
        ("eval.lrs=[1e-4, 1e-4]", r"eval\.lrs: .* names a learning rate twice"),
        ("eval.heldout_fraction=1.5", r"heldout_fraction: must be in \(0, 1\)"),
        ("budget.amount=0", r"budget\.amount: must be > 0"),
        ("eval.max_seq_len=4096", r"eval\.max_seq_len=4096 is longer than the arms' encoder takes"),
        ("ouput_dir=x", r"unknown config key 'ouput_dir' \(did you mean 'output_dir'\?\)"),
        ("launch.jobs=0", r"ablation-tiny\.yaml: launch\.jobs: expected >= 1, got 0"),
        ("launch.procs=0", r"ablation-tiny\.yaml: launch\.procs: expected >= 1, got 0"),
        ("launch.threads=-2", r"launch\.threads: expected >= 0, got -2"),
    ],
)
def test_ablation_errors_name_file_key_and_nearest(override, message, monkeypatch):
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=message):
        load_ablation(TINY, [override])


def test_ablation_file_with_a_bad_key_is_named(tmp_path):
    from pretrain.evaluation.ablation_plan import load_ablation

    cfg = tmp_path / "mine.yaml"
    cfg.write_text(f"base: {TINY}\neval: {{tasks: [{make_task(tmp_path / 't')}], epocs: 3}}\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: unknown config key 'eval\.epocs' \(did you mean 'epochs'\?\)"):
        load_ablation(str(cfg))


def test_an_ablation_inherits_another_with_base(tmp_path):
    """`base:` at the top of an ablation file: its keys over the base's, and arms it names replace the base's."""
    from pretrain.evaluation.ablation_plan import load_ablation

    cfg = tmp_path / "mine.yaml"
    task = make_task(tmp_path / "t")
    cfg.write_text(f"base: {TINY}\narms: {{mlm: {{}}, none: {{pretrain: false}}}}\neval: {{tasks: [{task}]}}\n")
    ab = load_ablation(str(cfg))
    assert list(ab.groups()) == ["mlm", "none"] and ab.eval.tasks == [str(task)] and ab.eval.max_seq_len == 64


def test_missing_task_says_where_to_get_it(tmp_path):
    from pretrain.evaluation.ablation_plan import load_ablation

    with pytest.raises(ConfigError, match=r"eval\.tasks: '.*/rte' has no train\.tsv.*nltk_data's `rte` corpus"):
        load_ablation(TINY, [f"eval.tasks=[{tmp_path / 'rte'}]"])


def test_two_tasks_of_one_directory_name_are_refused(tmp_path):
    """Results are kept by task directory name: the second 'mr' (the full set beside the shipped subset) was skipped
    as done, and the report showed one column for two."""
    from pretrain.evaluation.ablation_plan import load_ablation

    a, b = make_task(tmp_path / "a" / "mr"), make_task(tmp_path / "b" / "mr")
    with pytest.raises(ConfigError, match=r"eval\.tasks: two task directories named mr"):
        load_ablation(TINY, [f"eval.tasks=[{a}, {b}]"])


def test_cola_by_name_and_one_random_encoder_per_probe(tmp_path):
    """MCC for CoLA (a word of the folder name, not "chocolate"); --random-init probes see the same random encoder
    whatever the process drew before (its features are computed once, not per seed)."""
    import torch

    from pretrain.evaluation.finetune import encoder_features, load_task, main_metric

    assert [main_metric(n, "classification", 2) for n in ("cola", "glue-CoLA", "chocolate")] == [
        "mcc",
        "mcc",
        "accuracy",
    ]
    model, task = tiny_model(tmp_path / "model"), load_task(make_task(tmp_path / "t"))
    torch.manual_seed(1)
    first = encoder_features(model, task, random_init=True)
    torch.rand(100)  # whatever else this process drew meanwhile
    second = encoder_features(model, task, random_init=True)
    assert all(torch.equal(x, y) for x, y in zip(first, second))


@pytest.mark.parametrize("preset", ["ablation-tiny", "ablation", "ablation-gpu"])
def test_presets_parse_and_arms_carry_their_own_lr(preset, monkeypatch):
    """Every ablation preset is a valid typed config (its tasks replaced by the shipped ones, which a clean clone
    has); an arm's train options (rtd's learning rate) reach its runs and its recorded hyper-parameters."""
    from pretrain.evaluation.ablate import hyperparameters
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    ab = load_ablation(preset, ["eval.tasks=[data/tasks/mr]"] if preset != "ablation-tiny" else [])
    assert ab.eval.tasks == ["data/tasks/mr"] and ab.budget_amount > 0
    for arm in ab.arms:
        expected = 5e-4 if arm.group == "rtd" else ab.base.train.lr
        assert arm.cfg.train.lr == expected
        if arm.pretrain:
            assert hyperparameters(arm)["lr"] == expected
    if ab.budget_kind == "tokens":  # --print-commands plans each arm on launch.procs ranks: at least one step there
        assert ab.budget_amount >= ab.base.train.global_batch(ab.launch.procs) * ab.base.data.max_seq_len
    if preset == "ablation-gpu":
        assert len(ab.seeds) >= 4 and len(ab.eval.seeds) >= 5 and "full" in ab.eval.modes
        assert {"mlm", "mlm+sop", "span", "rtd", "none"} == set(ab.groups())
        assert hyperparameters(ab.groups()["rtd"][0])["overrides"] == {"objectives": {"rtd": {}}, "train": {"lr": 5e-4}}


def test_shipped_tasks_are_small_and_load():
    from pretrain.evaluation.finetune import load_task

    for name in ("mr", "subj"):
        for split in ("train.tsv", "dev.tsv"):
            assert (ROOT / "data" / "tasks" / name / split).stat().st_size < 300_000
        task = load_task(ROOT / "data" / "tasks" / name)
        assert task.labels == ["0", "1"] and len(task.dev[2]) == 1000


def test_finetune_mode_default_is_declared_once():
    """Full fine-tuning is what `pretrain finetune` does unless told (probes are what ablations use)."""
    import inspect

    from pretrain.evaluation.configs import EvalConfig, FinetuneConfig
    from pretrain.evaluation.finetune import finetune

    assert FinetuneConfig().mode == "full" == inspect.signature(finetune).parameters["mode"].default
    assert EvalConfig().modes == ["probe"]
    ev = EvalConfig(lrs=[1e-4], probe_lrs=[1e-2, 3e-2], max_train_examples=7, epochs=2)
    assert ev.finetune("full").lrs == [1e-4] and ev.finetune("probe").lrs == [1e-2, 3e-2]
    assert ev.finetune("probe").max_train == 7 and ev["modes"] == ["probe"]
    assert FinetuneConfig(mode="probe", epochs=2).resolved() == FinetuneConfig(
        mode="probe", epochs=2, lr=1e-2, batch_size=64
    )


# ---------------------------------------------------------------------------------------------- the protocol


def test_heldout_split_is_deterministic_disjoint_and_from_train_only(tmp_path):
    from pretrain.evaluation.configs import FinetuneConfig
    from pretrain.evaluation.finetune import heldout_split, load_task, sweep_lr

    fit, held = heldout_split(50, 0.1, seed=3)
    again = heldout_split(50, 0.1, seed=3)
    assert np.array_equal(fit, again[0]) and np.array_equal(held, again[1]) and len(held) == 5
    assert sorted([*fit, *held]) == list(range(50))
    assert not np.array_equal(held, heldout_split(50, 0.1, seed=4)[1])

    task = load_task(make_task(tmp_path / "t"))
    seen = []

    def score(view, fit, held, lr):  # a stand-in for training: best at lr 0.01, and it records what it was given
        seen.append((view, lr))
        return {0.001: 0.5, 0.01: 0.8, 0.1: 0.8}[lr]

    sweep = sweep_lr(task, FinetuneConfig(mode="probe", lrs=[0.001, 0.01, 0.1]), score)
    assert sweep["chosen"] == 0.01 and sweep["heldout_scores"] == [0.5, 0.8, 0.8]  # ties: the first
    assert sweep["heldout_examples"] == 4 and sweep["fit_examples"] == 36
    for view, _ in seen:  # never a dev sentence, in either part; its warnings name the part, not "dev"
        assert view.name == f"{task.name} (held-out part of train)"
        sentences = view.train[0] + view.dev[0]
        assert all(s.endswith(" train") for s in sentences) and len(set(sentences)) == len(sentences) == 40


def test_summary_has_the_median():
    from pretrain.evaluation.finetune import summarize

    s = summarize([{"accuracy": a} for a in (0.5, 0.9, 0.6, 0.7, 0.1)])["accuracy"]
    assert s["median"] == 0.6 and s["mean"] == pytest.approx(0.56) and s["std"] > 0


def test_sweep_then_full_train_on_a_real_model(tmp_path, capsys):
    """The chosen lr is the best on held-out, re-trained on all of train and scored on dev over 5 seeds."""
    from pretrain.evaluation.finetune import finetune, format_finetune

    model, task = tiny_model(tmp_path / "model"), make_task(tmp_path / "t")
    result = finetune(model, task, [1, 2, 3, 4, 5], mode="probe", epochs=3, lrs=[1e-4, 3e-1], heldout_fraction=0.25)
    sweep = result["lr_sweep"]
    assert sweep["heldout_examples"] == 10 and sweep["fit_examples"] == 30 and sweep["metric"] == "accuracy"
    assert result["lr"] == sweep["chosen"] == sweep["lrs"][int(np.argmax(sweep["heldout_scores"]))]
    assert result["train_examples"] == 40 and result["dev_examples"] == 16 and len(result["per_seed"]) == 5
    accuracy = [r["accuracy"] for r in result["per_seed"]]
    assert result["summary"]["accuracy"]["median"] == pytest.approx(float(np.median(accuracy)))
    assert "median" in format_finetune(result) and "chosen on 10 held-out" in format_finetune(result)
    plain = finetune(model, task, [1], mode="probe", epochs=1)
    assert plain["lr_sweep"] is None and plain["lr"] == 1e-2  # no sweep: the mode's default lr


def test_a_budget_follows_an_arms_schedule_and_refuses_to_cut_off_a_phase():
    from types import SimpleNamespace

    from pretrain.core.schedule import Schedule
    from pretrain.evaluation.ablation_plan import apply_budget
    from pretrain.train.setup import load_config

    def plan(kind, amount, *overrides, flops=None):
        cfg = load_config("tiny", ["train.max_steps=1000", "train.warmup_steps=10", *overrides])
        arm, ab = SimpleNamespace(name="two-phase", cfg=cfg), SimpleNamespace(path="ab.yaml", budget_kind=kind)
        ab.budget_amount = amount
        return apply_budget(ab, arm, flops or [0] * len(Schedule.of(cfg).phases)), arm

    # unscheduled: global batch 8 x 64 token slots a step
    assert plan("tokens", 10_000)[0]["max_steps"] == 10_000 // 512
    # 300 steps of 8 x 64, then 32 tokens in micro-batches of 4 (2 per step): 300 x 512 + 100 x 256
    phases = "schedule.phases=[{start: 300, max_seq_len: 32, micro_batch_size: 4}]"
    p, arm = plan("tokens", 300 * 512 + 100 * 256 + 255, phases)
    assert p["max_steps"] == 400 and arm.cfg.train.max_steps == 400
    assert p["tokens_per_step"] == (300 * 512 + 100 * 256) / 400  # the mean the report multiplies steps by
    # FLOPs: each phase's micro-batch cost times its micro-batches a step
    p, _ = plan("flops", 300 * 7 + 10 * 2 * 3, phases, flops=[7, 3])
    assert p["max_steps"] == 310
    # a budget that ends the arm before its second phase is refused, naming arm, step and phase
    with pytest.raises(ConfigError, match=r"arm 'two-phase': its tokens budget ends it at step 200: schedule\.phases"):
        plan("tokens", 200 * 512, phases)


def test_a_warm_up_cut_by_the_budget_is_said_and_recorded(capsys):
    """The budget cuts the warm-up to a tenth of an arm's steps (a preset's warm-up over a short budget left the
    whole run below its learning rate); it did so with no word, to another length per arm under a FLOPs budget."""
    from types import SimpleNamespace

    from pretrain.evaluation.ablation_plan import apply_budget
    from pretrain.train.setup import load_config

    def plan(warmup):
        cfg = load_config("tiny", ["train.max_steps=1000", f"train.warmup_steps={warmup}"])
        arm = SimpleNamespace(name="mlm", cfg=cfg)
        ab = SimpleNamespace(path="ab.yaml", budget_kind="tokens", budget_amount=50 * 512)  # 50 steps of 8 x 64
        return apply_budget(ab, arm, [0]), arm, capsys.readouterr().out

    p, arm, said = plan(20)
    assert p["warmup_steps"] == arm.cfg.train.warmup_steps == 5
    assert "note: arm mlm: train.warmup_steps 20 cut to 5, a tenth of the 50 steps its tokens budget gives" in said
    p, arm, said = plan(3)
    assert p["warmup_steps"] == arm.cfg.train.warmup_steps == 3 and "cut to" not in said


@pytest.mark.parametrize("preset", ["ablation", "ablation-gpu"])
def test_preset_seed_comments_say_what_their_seeds_can_show(preset):
    """The comment over `seeds:` states the sign-flip floor of that many seeds and the seeds each Holm family of the
    preset would need (it said ">= 3" was enough, where 3 seeds cannot go below p = 0.25)."""
    import yaml

    from pretrain.evaluation.report import PRIMARY, SECONDARY, main_mode, planned
    from pretrain.evaluation.stats import seeds_needed, sign_flip_floor

    path = ROOT / "configs" / f"{preset}.yaml"
    raw = yaml.safe_load(path.read_text())
    modes = raw["eval"]["mode"] if isinstance(raw["eval"]["mode"], list) else [raw["eval"]["mode"]]
    arms = {name: None for name in raw["arms"]}
    plan = planned({mode: {t: arms for t in raw["eval"]["tasks"]} for mode in modes}, main_mode(modes))
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("seeds:"))
    comment = " ".join(line.lstrip("# ") for line in lines[at - 3 : at])
    n = len(raw["seeds"])
    assert f"2/2^{n} = {sign_flip_floor(n):g}" in comment and "no difference can hold" in comment
    (m1, m2) = (sum(p[0] == family for p in plan) for family in (PRIMARY, SECONDARY))
    assert n < seeds_needed(m1) <= seeds_needed(m2)
    assert f"{seeds_needed(m1)} seeds for the primary family's {m1} comparisons" in comment
    assert f"{seeds_needed(m2)} for the secondary's {m2}" in comment


def test_an_override_of_a_section_merges_and_one_of_the_arms_replaces_them(monkeypatch):
    """`eval={seeds: [3]}` dropped the preset's tasks, mode and epochs (back to their defaults); `arms={...}` is what
    the ablation compares, as a file's arms replace its base's."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    ab = load_ablation(TINY, ["eval={seeds: [3]}", "arms={mlm: {objectives: {mlm: {}}}}"])
    assert (ab.eval.seeds, ab.eval.tasks, ab.eval.epochs, ab.eval.max_seq_len) == ([3], ["data/tasks/mr"], 5, 64)
    assert [arm.name for arm in ab.arms] == ["mlm"]
    ab = load_ablation(TINY, ["arms.mlm={objectives: {span: {}}}"])  # an arm's overrides, whole: span, not mlm + span
    assert set(ab.arms[0].cfg.objectives) == {"span"}


def test_an_override_of_the_runs_objectives_replaces_them_as_the_file_does(tmp_path, monkeypatch):
    """run.objectives={mlm: {}} over a file whose run: names mlm and sop was merged into both (since overrides of a
    mapping merge), so an arm without objectives of its own trained sop too; as a file's run: replaces its preset's
    objectives, the override's are the run's, as they were before overrides merged."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    text = (
        Path(TINY)
        .read_text()
        .replace("  wandb: {mode: disabled}\n", "  wandb: {mode: disabled}\n  objectives: {mlm: {}, sop: {}}\n")
    )
    (tmp_path / "ablation.yaml").write_text(text)
    arm = "arms={lr: {train: {lr: 0.001}}}"
    assert [set(a.cfg.objectives) for a in load_ablation(str(tmp_path / "ablation.yaml"), [arm]).arms] == [
        {"mlm", "sop"}
    ]
    ab = load_ablation(str(tmp_path / "ablation.yaml"), [arm, "run.objectives={mlm: {}}"])
    assert [set(a.cfg.objectives) for a in ab.arms] == [{"mlm"}]
    ab = load_ablation(str(tmp_path / "ablation.yaml"), [arm, "run={objectives: {mlm: {}}}"])  # within a section too
    assert [set(a.cfg.objectives) for a in ab.arms] == [{"mlm"}]
    ab = load_ablation(str(tmp_path / "ablation.yaml"), [arm, "run={train: {lr: 0.002}}"])  # a section still merges
    assert [(set(a.cfg.objectives), a.cfg.data.vocab_size) for a in ab.arms] == [({"mlm", "sop"}, 512)]


def test_an_ablation_based_on_another_replaces_its_runs_objectives_as_a_preset_does(tmp_path, monkeypatch):
    """A run preset that names objectives replaces its base's; an ablation file whose run: named them over a `base:`
    ablation's merged the two (mlm over mlm + sop: both), so an arm without objectives of its own trained sop too."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    text = Path(TINY).read_text().replace("base: tiny.yaml", f"base: {ROOT / 'configs' / 'tiny.yaml'}")
    (tmp_path / "parent.yaml").write_text(
        text.replace("  wandb: {mode: disabled}\n", "  wandb: {mode: disabled}\n  objectives: {mlm: {}, sop: {}}\n")
    )
    child = tmp_path / "child.yaml"
    child.write_text("base: parent.yaml\nrun: {objectives: {mlm: {}}}\narms: {lr: {train: {lr: 0.001}}}\n")
    ab = load_ablation(str(child))
    assert [set(a.cfg.objectives) for a in ab.arms] == [{"mlm"}] and ab.base.data.vocab_size == 512  # run merged


@pytest.mark.parametrize(
    "arm_data, key",
    [("{vocab_size: 1000}", "data.vocab_size=1000"), ("{tokenizer_type: bpe}", "data.tokenizer_type='bpe'")],
)
def test_an_arm_that_changes_the_shared_data_is_refused_not_run_on_the_shared(arm_data, key, monkeypatch):
    """An arm's data.vocab_size (or tokenizer type, corpus) was dropped for the shared run's, with no word: the arm
    trained on the one tokenizer and shards every arm shares, not on what it said. How samples are cut may differ."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=rf"arms\.mlm: {key} \(run: .*an arm may change only data\.packing"):
        load_ablation(TINY, [f"arms.mlm={{objectives: {{mlm: {{}}}}, data: {arm_data}}}"])
    ab = load_ablation(TINY, ["arms.mlm={objectives: {mlm: {}}, data: {packing: doc_bounded, vocab_size: 512}}"])
    assert [arm.cfg.data.packing for arm in ab.arms] == ["doc_bounded", "full_sentences", "full_sentences"]


def test_an_arms_pretrain_is_typed_as_a_bool_setting(monkeypatch):
    """`pretrain: "false"` (quoted) or `pretrain: nope` was bool() of a non-empty text: true, so the random-encoder
    baseline an arm meant to be was pretrained."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    arm = "arms={{{}: {{pretrain: {}, objectives: {{mlm: {{}}}}}}}}"
    assert [a.pretrain for a in load_ablation(TINY, [arm.format("none", '"false"')]).arms] == [False]
    assert [a.pretrain for a in load_ablation(TINY, [arm.format("x", "yes")]).arms] == [True]
    with pytest.raises(ConfigError, match=r"ablation-tiny\.yaml: arms\.x\.pretrain: value 'nope' is not a valid bool"):
        load_ablation(TINY, [arm.format("x", "nope")])
    # the report finds the random encoder by its name: another untrained arm was compared as a pretrained one
    with pytest.raises(ConfigError, match=r"arms\.random: pretrain: false: the random-encoder .* rename this arm"):
        load_ablation(TINY, [arm.format("random", "false")])
    with pytest.raises(ConfigError, match=r"arms\.none: pretrain: true: .* give this pretrained arm another name"):
        load_ablation(TINY, [arm.format("none", "true")])


@pytest.mark.parametrize("name", ["../../notes", "a/b", "a|b", "..", "-x", "a b", "x."])
def test_an_arm_name_that_is_no_plain_file_name_is_refused(name, tmp_path, monkeypatch):
    """An arm's name names its run directories and config files: '../../notes' wrote <out>/../notes.yaml over a
    user's file; 'a|b' shifted the report table's columns."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=rf"arms: '{re.escape(name)}' cannot name an arm: use letters, digits"):
        load_ablation(TINY, [f"output_dir={tmp_path / 'ab'}", f'arms={{"{name}": {{objectives: {{mlm: {{}}}}}}}}'])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("spec", ["3", "true", "[mlm]", "mlm"])
def test_an_arm_that_is_not_a_mapping_is_named_not_a_traceback(spec, monkeypatch):
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=r"ablation-tiny\.yaml: arms\.x: expected a mapping of the arm's overrides"):
        load_ablation(TINY, [f"arms={{x: {spec}}}"])


def test_an_arms_own_length_is_refused_where_the_budget_sets_it(monkeypatch):
    """apply_budget replaced an arm's train.max_steps (tokens, FLOPs) or max_minutes (time) with the budget's, so an
    arm meant to train longer trained as long as the others, with no word."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    longer = "arms.mlm={objectives: {mlm: {}}, train: {max_steps: 40}}"
    with pytest.raises(ConfigError, match=r"arms\.mlm: train\.max_steps=40: the tokens budget sets every arm's"):
        load_ablation(TINY, [longer])
    # under a time budget, run.train.max_steps bounds every arm alike; one arm's own cut it short of the others
    timed = load_ablation(TINY, ["run.train.max_steps=40", "budget={kind: time, amount: 1}"])
    assert {arm.cfg.train.max_steps for arm in timed.arms} == {40}
    with pytest.raises(ConfigError, match=r"arms\.mlm: train\.max_steps=40: the time budget sets every arm's max_min"):
        load_ablation(TINY, [longer, "budget={kind: time, amount: 1}"])
    with pytest.raises(ConfigError, match=r"arms\.mlm: train\.max_minutes=5: the time budget sets every arm's"):
        load_ablation(TINY, ["arms.mlm={train: {max_minutes: 5}}", "budget={kind: time, amount: 1}"])


def test_an_arm_that_changes_the_schedule_phases_is_refused(monkeypatch):
    """An arm's schedule.phases trained it on other sequence lengths than the others at the same budget, compared
    as equals; the arms' sequence length was held only through data.max_seq_len."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    phases = "schedule: {phases: [{start: 0, max_seq_len: 16, micro_batch_size: 32}]}"
    with pytest.raises(ConfigError, match=r"arms\.mlm: an arm may change .* not the encoder, seed, sequence length or"):
        load_ablation(TINY, [f"arms.mlm={{objectives: {{mlm: {{}}}}, {phases}}}"])


@pytest.mark.parametrize(
    "override, where",
    [
        ("arms.mlm={objectives: {mlm: {}}, output_dir: elsewhere}", "arms.mlm: output_dir"),
        ("arms.mlm={objectives: {mlm: {}}, name: mine}", "arms.mlm: name"),
        ("run.data.tokenizer=my-tokenizer", "run: data.tokenizer"),
        ("run.data.shards=my-shards", "run: data.shards"),
        ("run.output_dir=/tmp/elsewhere", "run: output_dir"),
    ],
)
def test_what_the_ablation_sets_is_refused_not_overridden(override, where, monkeypatch):
    """Each arm's run directory and name, and the tokenizer and shards, are the ablation's: an arm's output_dir or
    a run.data.tokenizer was replaced with no word, so the user looked for the arm, or reused a tokenizer, where it
    was not."""
    from pretrain.evaluation.ablation_plan import load_ablation

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=rf"{re.escape(where)}: set by the ablation .*own output_dir instead"):
        load_ablation(TINY, [override])
    assert len(load_ablation(TINY, []).arms) == 3
