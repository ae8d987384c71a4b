"""Evaluation, downstream fine-tuning and the ablation runner, on tiny data made here.

The end-to-end ablation (slow) trains two pretrained arms and the no-pretraining baseline through the CLI
(each arm in its own `pretrain train` process), exports, probes a tiny sentence-pair task, writes the
report, and is then re-run to check that finished arms are skipped. The report's notes are tested on results made
without training in test_ablation_report.py.
"""

import json
import math
from pathlib import Path

import pytest
from helpers import PAIR_WORDS, make_pair_task, one_line_error, snapshot, tiny_bert, tsv_task
from helpers import run_cli as pretrain

from pretrain.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"


def ablation_args(tmp: Path, corpus: Path, task: Path, *extra) -> list[str]:
    import objectives

    arms = "{mlm: {objectives: {mlm: {}}}, none: {pretrain: false}"
    if "span" in objectives.REGISTRY:  # a third arm with another objective, when it is there
        arms += ", span: {objectives: {span: {}}}"
    arms += "}"
    return [
        "ablate",
        ROOT / "configs" / "ablation-tiny.yaml",
        f"output_dir={tmp / 'abl'}",
        f"run.data.corpus=[{corpus}]",
        f"eval.tasks=[{task}]",
        f"arms={arms}",
        "budget.amount=1536",
        "eval.epochs=3",
        "launch.threads=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ablation")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    task = make_pair_task(tmp / "pairs")
    proc = pretrain(*ablation_args(tmp, corpus, task), cwd=ROOT)
    return {"dir": tmp / "abl", "corpus": corpus, "task": task, "proc": proc, "tmp": tmp}


@pytest.mark.slow
def test_ablation_end_to_end_equal_budgets_report_and_resume(ablation):
    out = ablation["dir"]
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    trained = {k: v for k, v in runs.items() if v["pretraining"]["steps"]}
    assert "none" in runs and runs["none"]["pretraining"]["tokens_seen"] == 0
    assert set(trained) >= {"mlm"}
    # budget kind tokens: every pretrained arm ran the same steps and consumed the same tokens
    assert {v["pretraining"]["steps"] for v in trained.values()} == {1536 // (8 * 64)}
    assert len({v["pretraining"]["token_slots"] for v in trained.values()}) == 1
    assert len({v["pretraining"]["tokens_seen"] for v in trained.values()}) == 1  # packed arms: same samples
    for name, v in runs.items():
        (ds,) = v["downstream"]["probe"].values()
        assert ds["pair"] and len(ds["per_seed"]) == 2 and 0 <= ds["summary"]["accuracy"]["mean"] <= 1
        assert len(ds["dev_predictions"]) == 2 and len(ds["dev_predictions"][0]) == len(ds["dev_labels"]) == 24
        assert (out / "arms" / name / "hf" / "config.json").is_file()
        assert (out / "configs" / f"{name}.yaml").is_file()
    # every arm against none (primary: the only mode), the pretrained arms against each other (secondary), each
    # family Holm-adjusted on its own, with replicates enough for it
    comparisons = results["comparisons"]
    pairs = {(c["a"], c["b"]): c["family"] for c in comparisons}
    assert pairs[("mlm", "none")] == "primary" and all(c["p_holm"] >= c["p"] for c in comparisons)
    assert all(f == ("primary" if b == "none" else "secondary") for (_, b), f in pairs.items())
    assert results["main_mode"] == "probe" and all(f["floor"] < 0.05 for f in results["families"].values())
    kinds = {n["kind"]: n for n in results["notes"]}
    assert kinds["few_seeds"]["seeds"] == 1  # the notes say what a single seed leaves out
    assert [d["task"] for d in results["detectable"]] == ["pairs"] and results["detectable"][0]["examples"] == 24
    report = (out / "report.md").read_text()
    assert report.startswith("# ") and "pretrain ablate" in report and "What this budget can and cannot show" in report
    assert "| mlm |" in report and "| none |" in report and " ± " in report and "vs none" in report
    assert "Run on: " in report and "not recorded" not in report and "torch " in report  # device, versions, date
    # the reproducibility record: code, versions, command, configs and the sha256 of every input
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance == results["provenance"] and len(provenance["git"]["commit"]) == 40
    assert provenance["versions"]["torch"] and "ablate" in provenance["command"]
    assert set(provenance["configs"]) == {"ablation", *runs}
    hashes = provenance["sha256"]
    assert set(hashes) == {"corpus", "tokenizer", "shards", "tasks"}
    assert all(h != "missing" for group in hashes.values() for h in group.values())
    assert any(p.endswith("tokenizer.json") for p in hashes["tokenizer"]) and len(hashes["shards"]) > 1
    assert {Path(p).name for p in hashes["tasks"]} == {"train.tsv", "dev.tsv"}
    assert (out / "arms" / "none" / "provenance.json").is_file()  # the arm no trainer runs gets its own
    for png in ("loss_curves.png", "downstream.png", "significance.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    # the same command again: nothing retrained or re-evaluated, fast
    again = pretrain(*ablation_args(ablation["tmp"], ablation["corpus"], ablation["task"]), cwd=ROOT)
    assert again.stdout.count("finished earlier, skipped") == len(runs)
    assert "training (" not in again.stdout


@pytest.mark.slow
def test_runs_side_by_side_give_what_runs_one_at_a_time_give(ablation):
    """launch.jobs=2: the same ablation, two runs at a time each in a process of its own, gives every run the same
    pretraining and the same dev predictions as the fixture's one-at-a-time runs; the output says which run each
    line is from, each run's log holds its own, and the same command again skips every run."""
    tmp = ablation["tmp"]
    args = [*ablation_args(tmp, ablation["corpus"], ablation["task"]), "launch.jobs=2", f"output_dir={tmp / 'sbs'}"]
    proc = pretrain(*args, cwd=ROOT)
    ours = json.loads((tmp / "sbs" / "results.json").read_text())["runs"]
    theirs = json.loads((ablation["dir"] / "results.json").read_text())["runs"]
    assert list(ours) == list(theirs)
    for name, run in ours.items():
        (ds,) = run["downstream"]["probe"].values()
        (expected,) = theirs[name]["downstream"]["probe"].values()
        assert ds["dev_predictions"] == expected["dev_predictions"] and ds["summary"] == expected["summary"], name
        assert run["pretraining"]["final_loss"] == theirs[name]["pretraining"]["final_loss"], name
        assert f"[{name}] [ablate] arm {name}: downstream" in proc.stdout
        assert f"arm {name}: downstream" in (tmp / "sbs" / "logs" / f"{name}.log").read_text()
    assert "[mlm] [pretrain] train: step 3/3" in proc.stdout
    # on a CPU (or one GPU) the two shared it: the report says so of its wall times; the runs one at a time did not
    shared = "up to 2 runs at a time shared a device (their wall times include the sharing)"
    assert shared in (tmp / "sbs" / "report.md").read_text()
    assert "shared a device" not in (ablation["dir"] / "report.md").read_text()
    again = pretrain(*args, cwd=ROOT)
    assert again.stdout.count("finished earlier, skipped") == len(ours) and "training (" not in again.stdout


@pytest.mark.slow
def test_a_changed_config_is_refused_rather_than_mixed_into_the_runs_done(ablation):
    """A run skipped as finished, or resumed from its plan, with another budget or learning rate would sit in the
    report under settings it did not have: the ablation is refused, naming the change, and left as it was. (Evaluation
    settings alone re-open the evaluation, the pretraining kept: tests/test_ablation_workflow.py.)"""
    tmp, corpus, task, out = ablation["tmp"], ablation["corpus"], ablation["task"], ablation["dir"]
    before = snapshot(out)
    for change, said in (
        ("budget.amount=3072", "budget.amount: 1536.0 -> 3072.0"),
        ("arms.mlm={objectives: {mlm: {}}, train: {lr: 0.5}}", "run.train.lr: 0.001 -> 0.5"),
    ):
        for command in ([], ["--print-commands"]):
            proc = pretrain(*ablation_args(tmp, corpus, task, change), *command, cwd=ROOT, rc=2)
            one_line_error(proc, "ran with other settings", said, "another output_dir")
        assert snapshot(out) == before


@pytest.mark.slow
def test_the_record_of_an_ablation_goes_on_elsewhere_without_its_weights(ablation):
    """What a short-lived machine sends back (--copy-record): the finished runs' records and the tokenizer, no weights.
    From it the same command skips those runs and reports the same numbers; --within-minutes leaves a run that would not
    fit for the next invocation, which finishes it and writes the report."""
    import shutil

    tmp, corpus, task = ablation["tmp"], ablation["corpus"], ablation["task"]
    original = json.loads((ablation["dir"] / "results.json").read_text())
    runs = set(original["runs"])
    record = tmp / "elsewhere" / "abl"  # where ablation_args(tmp / "elsewhere") writes
    pretrain(*ablation_args(tmp, corpus, task), "--copy-record", record, cwd=ROOT)
    files = {p.relative_to(record).as_posix() for p in record.rglob("*") if p.is_file()}
    assert {f"arms/{run}/state.json" for run in runs} | {"tokenizer/tokenizer.json", "ablation.yaml"} <= files
    assert not [f for f in files if f.endswith(".safetensors") or "checkpoints/" in f or f.startswith("shards/")]
    assert sum((record / f).stat().st_size for f in files) < 2_000_000
    # a second copy into the same place is refused, and leaves the first whole
    again = pretrain(*ablation_args(tmp, corpus, task), "--copy-record", record, cwd=ROOT, rc=2)
    assert f"--copy-record {record}: not a new or empty directory" in again.stderr
    assert {p.relative_to(record).as_posix() for p in record.rglob("*") if p.is_file()} == files
    # an empty directory that cannot be replaced (a symlink to one here; a mount point alike) gets the same record
    (tmp / "mounted").mkdir()
    (tmp / "link").symlink_to(tmp / "mounted")
    pretrain(*ablation_args(tmp, corpus, task), "--copy-record", tmp / "link", cwd=ROOT)
    assert {p.relative_to(tmp / "mounted").as_posix() for p in (tmp / "mounted").rglob("*") if p.is_file()} == files
    assert (tmp / "link").is_symlink()

    partial = tmp / "partial" / "abl"  # a record sent back before `none` had run
    shutil.copytree(record, partial)
    for leftover in ("arms/none", "configs/none.yaml", "report.md", "results.json"):
        shutil.rmtree(partial / leftover) if (partial / leftover).is_dir() else (partial / leftover).unlink()

    proc = pretrain(*ablation_args(tmp / "elsewhere", corpus, task), cwd=ROOT)
    assert proc.stdout.count("finished earlier, skipped") == len(runs) and "training (" not in proc.stdout
    rebuilt = json.loads((record / "results.json").read_text())
    assert {k: v for k, v in rebuilt.items() if k != "provenance"} == {
        k: v for k, v in original.items() if k != "provenance"
    }

    # the mlm and span runs took seconds each: none, judged by them, does not fit in a few milliseconds
    args = ablation_args(tmp / "partial", corpus, task)
    proc = pretrain(*args, "--within-minutes", "0.0001", cwd=ROOT)
    assert ": none left for the next run (it should take ~" in proc.stdout
    assert "left for the next run of the same command: none" in proc.stdout
    assert not (partial / "arms" / "none" / "state.json").exists() and not (partial / "report.md").exists()
    proc = pretrain(*args, "--within-minutes", "60", cwd=ROOT)
    assert "arm none: downstream" in proc.stdout and (partial / "report.md").is_file()
    finished = json.loads((partial / "results.json").read_text())
    assert set(finished["runs"]) == runs
    assert finished["runs"]["none"]["downstream"] == original["runs"]["none"]["downstream"]  # the same inputs

    # A task added to a copied record re-opens its finished runs, whose state says exported while hf/ is not there
    # (evaluation failed on it at every re-run): the random encoder is rebuilt and scored on the new task; a trained
    # arm fails saying its weights are not in this record and what to do, and the report shows the others.
    extra = make_pair_task(tmp / "extra")
    args = ablation_args(tmp / "elsewhere", corpus, task)
    args[args.index(f"eval.tasks=[{task}]")] = f"eval.tasks=[{task},{extra}]"
    timed = json.loads((record / "arms" / "none" / "state.json").read_text())["eval_s"]
    proc = pretrain(*args, cwd=ROOT, rc=2)
    assert "arm mlm FAILED (UserError: arm mlm: trained, but its weights are not in" in proc.stdout
    assert "Copy its hf/ or checkpoints/ from where it trained" in proc.stdout
    none = json.loads((record / "arms" / "none" / "state.json").read_text())
    assert set(none["downstream"]["probe"]) == {task.name, "extra"} and (record / "arms/none/hf/config.json").is_file()
    assert none["downstream"]["probe"][task.name] == original["runs"]["none"]["downstream"]["probe"][task.name]
    # its time grows by the new task's: it was replaced by it, and --within-minutes then expected the arm's next
    # seed to take those few seconds
    assert none["eval_s"] > timed


def test_a_run_is_expected_to_take_as_long_as_the_runs_timed_so_far(tmp_path):
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import expected_seconds

    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    ab = load_ablation(str(ROOT / "configs" / "ablation-tiny.yaml"), [task, "seeds=[7, 8]"])
    arm = {a.name: a for a in ab.arms}
    assert expected_seconds(ab, arm["span-seed7"], {}) is None  # nothing timed: the run starts
    timed = {"mlm-seed7": 30.0, "mlm-seed8": 50.0, "span-seed7": 20.0}
    assert expected_seconds(ab, arm["span-seed8"], timed) == 20.0  # another seed of the same arm
    assert expected_seconds(ab, arm["mlm-seed8"], timed) == 50.0  # the longest of that arm
    assert expected_seconds(ab, arm["none-seed7"], timed) == 50.0  # no run of its arm yet: the longest of any


@pytest.mark.slow
def test_flops_budget_is_equal_within_one_step(ablation):
    from pretrain.evaluation.ablation_plan import apply_budget, load_ablation, measure_phase_flops

    tmp = ablation["tmp"]
    ab = load_ablation(
        str(ROOT / "configs" / "ablation-tiny.yaml"),
        [
            str(a)
            for a in ablation_args(
                tmp, ablation["corpus"], ablation["task"], "budget.kind=flops", "budget.amount=2e10"
            )[2:]
        ],
    )
    spent, per_step = {}, {}
    for arm in ab.arms:
        if arm.pretrain:
            plan = apply_budget(ab, arm, measure_phase_flops(arm.cfg))  # reuses the data built by the fixture
            spent[arm.name] = plan["max_steps"] * plan["flops_per_step"]
            per_step[arm.name] = plan["flops_per_step"]
            assert spent[arm.name] <= 2e10 < spent[arm.name] + per_step[arm.name]
    assert max(spent.values()) - min(spent.values()) <= max(per_step.values())


@pytest.mark.slow
def test_eval_on_a_run_gives_accuracy_and_perplexity(ablation):
    run = ablation["dir"] / "arms" / "mlm"
    proc = pretrain("eval", run, "--corpus", ablation["corpus"], "--max-samples", 8, "--max-seq-len", 64, cwd=ROOT)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 <= result["accuracy"] <= 1 and math.isfinite(result["perplexity"]) and result["masked_tokens"] > 0
    assert "perplexity" in proc.stdout
    # the exported directory, scored on the same shards with the same masks, gives the same numbers
    from pretrain.evaluation.evaluate import evaluate_mlm

    exported = evaluate_mlm(run / "hf", shards=result["shards"], max_samples=8, max_seq_len=64)
    assert exported["masked_tokens"] == result["masked_tokens"]
    assert exported["loss"] == pytest.approx(result["loss"], rel=1e-3)
    # longer than the model's positions: named, not an IndexError
    proc = pretrain("eval", run, "--shards", result["shards"], "--max-seq-len", 4096, cwd=ROOT, rc=2)
    assert "--max-seq-len 4096 is longer than" in proc.stderr and "(128 positions)" in proc.stderr


def test_eval_without_max_seq_len_fits_a_model_of_fewer_positions(tmp_path):
    """The default is 128 tokens, or the model's positions where it has fewer; a longer length given is refused."""
    from pretrain.evaluation.evaluate import evaluate_mlm

    model = tiny_bert(tmp_path / "m64", PAIR_WORDS, positions=64)
    corpus = tmp_path / "held.jsonl"
    text = " ".join(f"the {w} ." for w in PAIR_WORDS * 3)
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(4)))
    (model / "trainer_state.json").write_text("{}")  # as in a transformers Trainer's checkpoint-N/: still theirs
    result = evaluate_mlm(model, corpus=[str(corpus)], max_samples=2)
    assert result["max_seq_len"] == 64 and result["masked_tokens"] > 0
    with pytest.raises(UserError, match=r"--max-seq-len 65 is longer than .* \(64 positions\)"):
        evaluate_mlm(model, corpus=[str(corpus)], max_samples=2, max_seq_len=65)
    with pytest.raises(UserError, match=r"--max-seq-len 2: .* \(>= 3\)"):
        evaluate_mlm(model, corpus=[str(corpus)], max_seq_len=2)
    for short in (3, 5):  # every chunk, the last one of only the closing [SEP] included (it was an IndexError)
        assert evaluate_mlm(model, corpus=[str(corpus)], max_seq_len=short)["max_seq_len"] == short


@pytest.mark.slow
def test_eval_reads_a_held_out_corpus_as_the_run_read_its_own(tmp_path, capsys):
    """A run trained on JSON Lines with its text under `body`: `pretrain eval RUN --corpus` reads held-out data of that
    format (it read `text` only: no documents); a .txt held-out file is read as the run reads plain text (paragraphs),
    or a document per line with --text-documents lines, each reading built and cached apart."""
    from helpers import run_args

    from pretrain.cli import main

    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:26]]
    corpus, held, held_txt = tmp_path / "train.jsonl", tmp_path / "held.jsonl", tmp_path / "held.txt"
    corpus.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts[:20]))
    held.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts[20:24]))
    held_txt.write_text("".join(" ".join(t.split()) + "\n" for t in texts[20:26]))  # a document per line
    pretrain("run", *run_args(tmp_path, corpus, "data.text_field=body"), "--no-demo", cwd=tmp_path)

    def documents(*args) -> int:
        assert main(["eval", str(tmp_path / "r"), "--max-samples", "2", *args]) == 0
        shards = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["shards"]
        return json.loads((Path(shards) / "manifest.json").read_text())["counts"]["documents"]

    assert documents("--corpus", str(held)) == 4
    # without --max-seq-len a run is scored at the length it trained at, 64 of its 128 positions (positions 64-127
    # never had a gradient: at 128 it was scored on untrained embeddings); a HuggingFace directory at its positions
    for target, length, reading in ((tmp_path / "r", 64, []), (tmp_path / "r" / "hf", 128, ["--text-field", "body"])):
        assert main(["eval", str(target), "--corpus", str(held), "--max-samples", "1", *reading]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["max_seq_len"] == length
    # a checkpoint's held-out shards go in its run's eval/, as the run's do: not into the checkpoint (rotated away)
    checkpoint = tmp_path / "r" / "checkpoints" / "step_00000003"
    assert main(["eval", str(checkpoint), "--corpus", str(held), "--max-samples", "1"]) == 0
    shards = Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["shards"])
    assert shards.parent == tmp_path / "r" / "eval" and not (checkpoint / "eval").exists()
    assert documents("--corpus", str(held_txt), "--text-documents", "lines") == 6
    assert documents("--corpus", str(held_txt)) == 1  # paragraphs, as the run reads text: one without blank lines
    assert main(["eval", str(tmp_path / "r"), "--corpus", str(held), "--text-field", "text"]) == 2
    assert "'text'" in capsys.readouterr().err  # the field it looked for, named
    shards = tmp_path / "r" / "shards"  # tokenized already: how to read text means nothing there
    assert main(["eval", str(tmp_path / "r"), "--shards", str(shards), "--text-documents", "lines"]) == 2
    assert "--shards are tokenized already" in capsys.readouterr().err


@pytest.mark.slow
def test_finetune_pair_task_two_seeds(ablation, capsys):
    from pretrain.cli import main
    from pretrain.evaluation.finetune import finetune

    model = ablation["dir"] / "arms" / "none" / "hf"
    result = finetune(model, ablation["task"], [1, 2], mode="full", epochs=1, batch_size=16, max_seq_len=32)
    assert result["pair"] and result["kind"] == "classification" and len(result["per_seed"]) == 2
    for metric in ("accuracy", "mcc"):
        assert set(result["summary"][metric]) == {"mean", "std", "median"} and result["summary"][metric]["std"] >= 0
    assert (
        main(["finetune", str(model), str(ablation["task"]), "--seeds", "2", "--mode", "probe", "--epochs", "2"]) == 0
    )
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "+-" in printed and "seeds [1, 2]" in printed


def test_malformed_tsv_names_file_and_line(tmp_path):
    from pretrain.evaluation.finetune import load_task

    task = make_pair_task(tmp_path / "t", n_train=4, n_dev=2)
    lines = (task / "train.tsv").read_text().splitlines()
    lines[2] = "only one field"
    (task / "train.tsv").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"train\.tsv:3: 1 tab-separated field"):
        load_task(task)


def test_label_types_and_metrics(tmp_path):
    from pretrain.evaluation.finetune import load_task, matthews_corr, task_metrics

    d = tmp_path / "reg"
    d.mkdir()
    for split in ("train", "dev"):
        (d / f"{split}.tsv").write_text("sentence\tlabel\na b\t0.5\nc d\t1.25\ne f\t3\n")
    task = load_task(d)
    assert task.kind == "regression" and not task.pair
    import numpy as np

    m = task_metrics(task, np.array([0.4, 1.3, 2.9]), np.array([0.5, 1.25, 3.0]))
    assert m["pearson"] > 0.99 and m["spearman"] == pytest.approx(1.0)
    assert matthews_corr(np.array([1, 0, 1, 0]), np.array([1, 0, 1, 0])) == pytest.approx(1.0)
    assert matthews_corr(np.array([1, 0, 1, 0]), np.array([1, 1, 1, 1])) == 0.0


def test_ablation_config_errors_name_the_key(tmp_path):
    from pretrain.core.errors import ConfigError
    from pretrain.evaluation.ablation_plan import load_ablation

    cfg = str(ROOT / "configs" / "ablation-tiny.yaml")
    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    with pytest.raises(ConfigError, match="budget.kind"):
        load_ablation(cfg, [task, "budget.kind=steps"])
    with pytest.raises(ConfigError, match="arms.mlm.*train.lrr"):
        load_ablation(cfg, [task, "arms.mlm.train.lrr=1"])
    with pytest.raises(ConfigError, match="not the encoder"):
        load_ablation(cfg, [task, "arms.mlm.model.hidden_size=128"])
    with pytest.raises(ConfigError, match="eval.tasks.*nowhere"):
        load_ablation(cfg, ["eval.tasks=[nowhere]"])


def test_labels_one_class_and_whole_numbers(tmp_path, capsys):
    from pretrain.evaluation.finetune import load_task

    one = tmp_path / "one"
    one.mkdir()
    for split in ("train", "dev"):
        (one / f"{split}.tsv").write_text("sentence\tlabel\na b\tyes\nc d\tyes\n")
    with pytest.raises(UserError, match=r"train\.tsv: every label is 'yes': classification needs at least two"):
        load_task(one)
    floats = tmp_path / "floats"
    floats.mkdir()
    (floats / "train.tsv").write_text("sentence\tlabel\na b\t0.0\nc d\t1.0\ne f\t1.0\n")
    (floats / "dev.tsv").write_text("sentence\tlabel\na b\t1\nc d\t0.0\n")
    task = load_task(floats)
    assert task.kind == "classification" and task.labels == ["0", "1"] and task.dev[2] == [1, 0]
    assert "whole numbers, read as classes" in capsys.readouterr().err
    assert load_task(floats, "regression").kind == "regression"


def test_several_pretraining_seeds_make_one_run_per_arm_and_seed(tmp_path):
    from pretrain.core.errors import ConfigError
    from pretrain.evaluation.ablation_plan import load_ablation

    cfg = str(ROOT / "configs" / "ablation-tiny.yaml")
    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    ab = load_ablation(cfg, [task, "seeds=[7, 8]", "eval.mode=[probe, full]"])
    assert [(a.name, a.group, a.seed, a.cfg.train.seed) for a in ab.arms][:2] == [
        ("mlm-seed7", "mlm", 7, 7),
        ("mlm-seed8", "mlm", 8, 8),
    ]
    assert list(ab.groups()) == ["mlm", "span", "none"] and ab.eval["modes"] == ["probe", "full"]
    with pytest.raises(ConfigError, match="seeds: expected a list of distinct integers"):
        load_ablation(cfg, [task, "seeds=[7, 7]"])
    with pytest.raises(ConfigError, match="eval.mode: 'fine' is not one of probe, full"):
        load_ablation(cfg, [task, "eval.mode=fine"])


def test_a_task_replaced_under_its_name_is_scored_again(tmp_path, monkeypatch, capsys):
    """Results are filed under a task's directory name: a full mr replacing a subset mr passed for it (the runs were
    finished, the report showed the subset's scores). Each result now carries its task files' sha256; a mismatch
    re-opens the run and scores that task alone again, saying why, and the report leaves the old result out."""
    from pretrain.evaluation import ablate, finetune
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import arm_settings, finished, read_state, write_state
    from pretrain.evaluation.report import cells
    from pretrain.evaluation.task_files import task_sha256

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    old, other = tsv_task(tmp_path / "subset" / "mr", 20), tsv_task(tmp_path / "trec", 20)
    ab = load_ablation(tiny, [f"eval.tasks=[{old},{other}]", f"output_dir={tmp_path / 'ab'}"])

    def result(task, n=20, sha=True):
        preds = {"main_metric": "accuracy", "dev_labels": [0, 1] * (n // 2), "dev_predictions": [[0] * n]}
        return {"task": Path(task).name, **preds, **({"task_sha256": task_sha256(task)} if sha else {})}

    for arm in ab.arms:  # every run scored on the subset, as `downstream` records it
        downstream = {"probe": {"mr": result(old), "trec": result(other)}}
        write_state(arm, {"settings": arm_settings(ab, arm), "evaluated": True, "downstream": downstream})
    assert all(finished(ab, read_state(arm)) for arm in ab.arms)

    new = tsv_task(tmp_path / "full" / "mr", 50)  # another task under the same name
    ab2 = load_ablation(tiny, [f"eval.tasks=[{new},{other}]", f"output_dir={tmp_path / 'ab'}"])
    assert not any(finished(ab2, read_state(arm)) for arm in ab2.arms)
    states = {arm.name: read_state(arm) for arm in ab2.arms}
    assert list(cells(ab2, states)["probe"]) == ["trec"]  # the subset's scores never pass for the full set's

    scored = []

    def run_finetune(model_dir, task, seeds, options):
        scored.append(Path(task))
        summary = {"accuracy": {"median": 0.5, "mean": 0.5, "std": 0.0}}
        return {**result(task, 50, sha=False), "summary": summary, "lr": 1e-3}

    monkeypatch.setattr(finetune, "run_finetune", run_finetune)
    again = ablate.downstream(ab2, tmp_path, read_state(ab2.arms[0])["downstream"])
    assert scored == [new]  # that task alone
    assert again["probe"]["mr"]["task_sha256"] == task_sha256(new) and len(again["probe"]["mr"]["dev_labels"]) == 50
    assert again["probe"]["trec"] == result(other)
    assert f"{new} holds other files than this run was scored on" in capsys.readouterr().out
    assert all((d / s).is_file() for d in (old, new) for s in ("train.tsv", "dev.tsv"))  # the user's files stay

    legacy = {"evaluated": True, "downstream": {"probe": {"mr": result(new, sha=False), "trec": result(other)}}}
    assert finished(ab2, legacy)  # recorded before hashes were kept: nothing tells, trusted


def test_a_copied_record_without_weights_says_so_when_a_task_is_added(tmp_path):
    """--copy-record keeps a finished run's state (exported: True) and config, not its hf/. A task added since re-opens
    the run: `exported` was trusted, and evaluation failed on the missing hf/ at every re-run, or, where the copied
    config's absolute paths still named the original directory, read that directory's weights. Now a trained arm
    without weights here fails saying so and what to do."""
    from pretrain.core.config import save_config
    from pretrain.evaluation.ablate import run_arm
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import arm_settings, write_state

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    a, b = tsv_task(tmp_path / "a", 20), tsv_task(tmp_path / "b", 20)
    origin = load_ablation(tiny, [f"eval.tasks=[{a}]", f"output_dir={tmp_path / 'origin'}"])
    arm = origin.arms[0]
    (arm.cfg.hf_dir).mkdir(parents=True)
    (arm.cfg.hf_dir / "config.json").write_text("{}")  # the weights stay on the machine it trained on

    ab = load_ablation(tiny, [f"eval.tasks=[{a},{b}]", f"output_dir={tmp_path / 'copy'}"])
    copied = ab.arms[0]
    save_config(arm.cfg, ab.arm_config_path(copied))  # the copied config: the origin's paths in it
    plan = {"max_steps": 6, "tokens_per_step": 512, "flops_per_step": 1.0}
    state = {"settings": arm_settings(ab, copied), "plan": plan, "trained": True, "exported": True, "evaluated": True}
    write_state(copied, {**state, "pretraining": {"steps": 6}, "downstream": {"probe": {"a": {"dev_labels": [0]}}}})
    with pytest.raises(UserError, match="trained, but its weights are not in") as err:
        run_arm(ab, copied)
    assert str(tmp_path / "copy" / "arms" / copied.name) in str(err.value) and "Copy its hf/" in str(err.value)


@pytest.mark.slow
def test_the_gpu_ablation_config_runs_every_path_at_tiny_sizes(tmp_path):
    """configs/ablation-gpu.yaml runs on lent GPU machines, a chunk per call: a path of it that fails there costs a
    session. The config itself, every setting but the sizes, the data and the seed counts, end to end here: a FLOPs
    budget, five arms (rtd at its own learning rate, mlm+sop, span, none), runs named by seed, full fine-tuning with
    its learning-rate sweep on held-out train and linear probes, on a sentence-pair, a single-sentence and a
    CoNLL token task, and the report."""
    from helpers import make_task, small_corpus, write_conll

    from pretrain.evaluation.fit import precision

    tasks = [make_pair_task(tmp_path / "rte"), make_task(tmp_path / "trec"), write_conll(tmp_path / "conll2000")]
    tiny = ["run.model.num_layers=1", "run.model.hidden_size=64", "run.model.num_heads=2"]
    tiny += ["run.model.intermediate_size=128", "run.train.micro_batch_size=8", "run.train.warmup_steps=2"]
    pretrain(
        "ablate",
        ROOT / "configs" / "ablation-gpu.yaml",
        f"output_dir={tmp_path / 'abl'}",
        f"run.data.corpus=[{small_corpus(tmp_path)}]",
        "run.data.vocab_size=512",
        *tiny,
        "budget.amount=2e10",
        f"eval.tasks=[{', '.join(map(str, tasks))}]",
        "eval.seeds=[1, 2]",
        "eval.max_train_examples=32",
        "eval.epochs=1",
        "seeds=[1234, 1235]",
        "launch.threads=1",
        cwd=ROOT,
    )
    results = json.loads((tmp_path / "abl" / "results.json").read_text())
    runs = results["runs"]
    arms = ("mlm", "mlm+sop", "span", "rtd", "none")
    assert sorted(runs) == sorted(f"{arm}-seed{seed}" for arm in arms for seed in (1234, 1235))
    trained = {name: run["pretraining"] for name, run in runs.items() if not name.startswith("none")}
    assert all(p["steps"] > 10 for p in trained.values()), trained
    # one FLOPs budget: every arm spent it to within one of its own steps
    assert all(2e10 - p["flops"] / p["steps"] <= p["flops"] <= 2e10 for p in trained.values()), trained
    assert {p["steps"] for name, p in trained.items() if name.startswith("rtd")} != {
        p["steps"] for name, p in trained.items() if name.startswith("mlm-")
    }  # rtd's generator costs FLOPs: fewer steps for the same budget
    for name, run in runs.items():
        for mode in ("full", "probe"):
            scored = run["downstream"][mode]
            assert sorted(scored) == ["conll2000", "rte", "trec"], (name, mode)
            assert scored["conll2000"]["main_metric"] == "chunk_f1" and scored["rte"]["pair"], (name, mode)
            assert scored["rte"]["seeds"] == [1, 2], (name, mode)
            assert {scored[task]["precision"] for task in scored} == {precision()}, (name, mode)  # fp32 on a CPU
    report = (tmp_path / "abl" / "report.md").read_text()
    assert all(f"| {arm} " in report for arm in arms), report[:3000]
    assert f"fine-tuning and probes in {precision()}." in report
