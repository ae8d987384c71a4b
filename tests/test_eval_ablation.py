"""Evaluation, downstream fine-tuning and the ablation runner, on tiny data made here.

The end-to-end ablation (slow) trains two pretrained arms and the no-pretraining baseline through the CLI
(each arm in its own `pretrain train` process), exports, probes a tiny sentence-pair task, writes the
report, and is then re-run to check that finished arms are skipped.
"""

import json
import math
import random
from pathlib import Path

import pytest
from helpers import run_cli as pretrain

from pretrain.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
WORDS = (
    "river stone cloud apple night music paper window garden silver engine forest letter market bridge "
    "candle winter summer doctor island"
).split()


def make_pair_task(directory: Path, n_train: int = 48, n_dev: int = 24, seed: int = 0) -> Path:
    """Do two short sentences share a word? Label 1 if they do (half the examples), 0 otherwise."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("dev", n_dev)):
        rows = ["sentence1\tsentence2\tlabel"]
        for i in range(n):
            a = rng.sample(WORDS, 3)
            rest = [w for w in WORDS if w not in a]
            b = rng.sample(rest, 3)
            if i % 2:
                b[rng.randrange(3)] = rng.choice(a)
            rows.append(f"the {' '.join(a)} .\tthe {' '.join(b)} .\t{i % 2}")
        (directory / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return directory


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


def test_a_run_is_expected_to_take_as_long_as_the_runs_timed_so_far(tmp_path):
    from pretrain.evaluation.ablate import expected_seconds, load_ablation

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
    from pretrain.evaluation.ablate import apply_budget, load_ablation, measure_phase_flops

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
    from pretrain.evaluation.ablate import load_ablation

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
    from pretrain.evaluation.ablate import load_ablation

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


def test_paired_bootstrap_against_hand_computed_cases():
    import numpy as np

    from pretrain.evaluation.stats import holm, paired_bootstrap

    y = np.array([0, 1] * 50)
    same = np.tile(y, (2, 3, 1))  # 2 pretraining seeds x 3 probe seeds, all right
    r = paired_bootstrap("accuracy", y, same, same)
    assert (r["diff"], r["low"], r["high"], r["p"]) == (0.0, 0.0, 0.0, 1.0)
    wrong = 1 - same
    r = paired_bootstrap("accuracy", y, same, wrong, replicates=999)
    assert r["diff"] == r["low"] == r["high"] == 1.0 and r["p"] == pytest.approx(2 / 1000)  # (0 + 1) / (999 + 1), x2
    # independent errors: the interval's half width is the normal one, 1.96 sqrt(var(a - b) / n)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 2000)
    right_a, right_b = rng.random(2000) < 0.8, rng.random(2000) < 0.7
    a, b = np.where(right_a, y, 1 - y)[None, None], np.where(right_b, y, 1 - y)[None, None]
    r = paired_bootstrap("accuracy", y, a, b)
    half = 1.96 * np.sqrt(np.var(right_a.astype(float) - right_b) / 2000)
    assert r["diff"] == pytest.approx(right_a.mean() - right_b.mean())
    assert (r["high"] - r["low"]) / 2 == pytest.approx(half, rel=0.1) and r["p"] < 0.01
    # MCC (CoLA's metric) resamples whole confusion matrices: a perfect and a constant predictor differ by 1
    r = paired_bootstrap("mcc", y, y[None, None], np.zeros_like(y)[None, None], replicates=200)
    assert r["diff"] == 1.0 and r["low"] == 1.0
    assert holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])


def _fake_results(ab, accuracy: dict[str, float], n: int = 400) -> dict:
    """States of every run of `ab` with probe predictions right with the given probability per arm."""
    import numpy as np

    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, n)
    results = {}
    for arm in ab.arms:
        preds = [np.where(rng.random(n) < accuracy[arm.group], labels, 1 - labels).tolist() for _ in ab.eval["seeds"]]
        result = {"task": "t", "main_metric": "accuracy", "dev_labels": labels.tolist(), "dev_predictions": preds}
        results[arm.name] = {
            "plan": {
                "max_steps": 10,
                "global_batch": 8,
                "tokens_per_step": 512,
                "flops_per_step": 1e9 * (2 if arm.group == "span" else 1),
            },
            "pretraining": {
                "steps": 10 if arm.pretrain else 0,
                "tokens_seen": 5000 if arm.pretrain else 0,
                "flops": 1e10,
                "wall_s": 3.0,
                "final_loss": {"mlm/loss": 6.0},
            },
            "downstream": {"probe": {"t": result}},
        }
    return results


def _notes_of(path: Path) -> dict[str, list[dict]]:
    """kind -> the data of each note of that kind, from a written report's results.json."""
    found: dict[str, list[dict]] = {}
    for note in json.loads((path.parent / "results.json").read_text())["notes"]:
        found.setdefault(note.pop("kind"), []).append(note)
    return found


def test_report_notes_follow_the_numbers(tmp_path):
    from pretrain.evaluation.ablate import load_ablation
    from pretrain.evaluation.report import write_report

    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    ab = load_ablation(
        str(ROOT / "configs" / "ablation-tiny.yaml"), [task, f"output_dir={tmp_path / 'a'}", "seeds=[1, 2]"]
    )
    ab.out.mkdir(parents=True)
    clear = write_report(ab, _fake_results(ab, {"mlm": 0.9, "span": 0.6, "none": 0.6}))
    notes = _notes_of(clear)
    (task_note,) = notes["task"]
    assert [i["a"] for i in task_note["above"]] == ["mlm"] and task_note["above"][0]["diff"] > 0.2
    assert task_note["same"] == ["span"] and task_note["family"] == "primary"
    assert [(i["a"], i["b"]) for i in notes["pairs"][0]["significant"]] == [("mlm", "span")]
    assert notes["cost"][0]["relative"] == {"span": pytest.approx(2.0)}  # FLOPs per token relative to mlm
    assert "nothing_separates" not in notes and "none_above_random" not in notes
    assert notes["seeds_untested"][0]["seeds"] == 2 and notes["few_seeds"][0]["seed_draws"] == 3
    assert "Run on: not recorded" in clear.read_text()  # these fake arms carry no host record
    flat = _notes_of(write_report(ab, _fake_results(ab, {"mlm": 0.6, "span": 0.6, "none": 0.6})))
    assert "nothing_separates" in flat and "none_above_random" not in flat and "seeds_untested" not in flat
    assert flat["task"][0]["above"] == [] and flat["task"][0]["same"] == ["mlm", "span"]
    assert "pairs" not in flat  # the note that nothing separates says it of the pairs too
    worse = _fake_results(ab, {"mlm": 0.6, "span": 0.3, "none": 0.6})
    for state in worse.values():
        state["host"] = {"device": "CPU: test (2 cores)", "torch": "2.x", "deepspeed": "0.y", "date": "2026-11-22"}
    worse = write_report(ab, worse)
    notes = _notes_of(worse)
    assert [i["a"] for i in notes["task"][0]["below"]] == ["span"] and notes["task"][0]["same"] == ["mlm"]
    assert notes["none_above_random"][0]["below"] == 1 and "nothing_separates" not in notes
    run_on = next(line for line in worse.read_text().splitlines() if line.startswith("Run on: "))
    assert all(part in run_on for part in ("CPU: test (2 cores)", "torch 2.x", "DeepSpeed 0.y", "2026-11-22"))


def test_report_scores_a_token_task_by_chunk_f1_beside_a_sentence_task(tmp_path):
    """A CoNLL task in an ablation: its cells are chunk F1 over sentences (pooled counts, as conlleval), compared and
    tested like any other task."""
    import numpy as np

    from pretrain.evaluation.ablate import load_ablation
    from pretrain.evaluation.report import write_report

    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    ab = load_ablation(
        str(ROOT / "configs" / "ablation-tiny.yaml"), [task, f"output_dir={tmp_path / 'a'}", "seeds=[1, 2]"]
    )
    ab.out.mkdir(parents=True)
    results = _fake_results(ab, {"mlm": 0.9, "span": 0.6, "none": 0.6})
    rng = np.random.default_rng(2)
    gold = rng.integers(1, 5, 300)
    recall = {"mlm": 0.95, "span": 0.6, "none": 0.6}
    for name, state in results.items():
        arm = next(a for a in ab.arms if a.name == name)
        found = [rng.binomial(gold, recall[arm.group]) for _ in ab.eval["seeds"]]
        preds = [np.stack([f, f + rng.integers(0, 2, len(gold))], -1).tolist() for f in found]
        chunk = {"task": "chunks", "main_metric": "chunk_f1", "dev_labels": gold.tolist(), "dev_predictions": preds}
        state["downstream"]["probe"]["chunks"] = chunk
    out = json.loads((write_report(ab, results).parent / "results.json").read_text())
    by_task = {(c["task"], c["a"], c["b"]): c for c in out["comparisons"]}
    assert by_task[("chunks", "mlm", "none")]["p_holm"] < 0.05 and by_task[("chunks", "mlm", "none")]["diff"] > 0.2
    assert by_task[("chunks", "span", "none")]["p"] > 0.05
    assert {d["metric"] for d in out["detectable"]} == {"accuracy", "chunk_f1"}


def test_report_tasks_follow_the_configs_order(tmp_path):
    """Columns and notes list tasks as the config does, not in a set's (hash-seeded) order: same inputs, same report."""
    from pretrain.evaluation.ablate import load_ablation
    from pretrain.evaluation.report import cells

    tasks = [make_pair_task(tmp_path / name, 4, 2) for name in ("zeta", "alpha", "mid")]
    ab = load_ablation(str(ROOT / "configs" / "ablation-tiny.yaml"), [f"eval.tasks=[{', '.join(map(str, tasks))}]"])
    one = _fake_results(ab, {"mlm": 0.6, "span": 0.6, "none": 0.6})
    for state in one.values():
        (result,) = state["downstream"]["probe"].values()
        state["downstream"]["probe"] = {name: result for name in ("mid", "alpha", "zeta")}
    assert [list(tasks) for tasks in cells(ab, one).values()] == [["zeta", "alpha", "mid"]]


def test_notes_say_which_uncorrected_differences_do_not_survive_holm():
    from pretrain.evaluation.report import Comparison, notes

    found = [
        Comparison("probe", "subj", "span", "none", 0.033, 0.005, 0.062, p=0.02, p_holm=0.6),
        Comparison("probe", "subj", "mlm", "none", -0.008, -0.03, 0.01, p=0.5, p_holm=1.0),
    ]
    (loose,) = [d for kind, d in notes(_ab(), {}, found, {}) if kind == "uncorrected"]
    assert [(i["a"], i["task"], i["diff"]) for i in loose["items"]] == [("span", "subj", 0.033)]
    assert loose["total"] == 2
    found[0].p_holm = 0.04  # significant after correction: no longer a caveat
    assert "uncorrected" not in {kind for kind, _ in notes(_ab(), {}, found, {})}


# ---------------------------------------------------------------------------------------------- notes, by kind


def _ab(modes=("probe",), seeds=2, kind="flops"):
    """What `notes` reads of an ablation."""
    from types import SimpleNamespace

    ev = {"modes": list(modes), "seeds": [1, 2], "pooling": "mean", "tasks": []}
    return SimpleNamespace(eval=ev, seeds=list(range(seeds)), budget_kind=kind, budget_amount=1e12)


def _pre(tokens=1e6, per_token=None, auc=None) -> dict:
    """`pretraining`'s numbers for mlm, span and the random encoder."""
    per_token = per_token or {"mlm": 4e6, "span": 5e6}
    pre = {}
    for arm, fpt in per_token.items():
        final = {f"{arm}/loss": 6.0, **({"rtd/disc_auc": auc} if auc is not None and arm == "rtd" else {})}
        pre[arm] = {
            "objectives": arm,
            "steps": 10,
            "tokens": tokens,
            "flops": 4e12,
            "wall_s": 1.0,
            "final": final,
            "flops_per_token": fpt,
            "failed": None,
            "runs": 2,
        }
    pre["none"] = {
        "objectives": "none (random init)",
        "steps": 0,
        "tokens": 0,
        "flops": 0,
        "wall_s": 0.0,
        "final": {},
        "flops_per_token": 0,
        "failed": None,
        "runs": 2,
    }
    return pre


def _table(modes=("probe",), n=100, full_gain=0.1) -> dict:
    """{mode: {"t": {arm: Cell}}}: mlm right on 70% of the examples, span and none on 60%; fine-tuning adds
    `full_gain` to each."""
    import numpy as np

    from pretrain.evaluation.report import Cell

    y = np.arange(n) % 2
    out = {}
    for mode in modes:
        gain = full_gain if mode == "full" else 0.0
        out[mode] = {
            "t": {
                arm: Cell("accuracy", y, np.where(np.arange(n) < int((acc + gain) * n), y, 1 - y)[None, None])
                for arm, acc in (("mlm", 0.7), ("span", 0.6), ("none", 0.6))
            }
        }
    return out


def _cmp(a, b="none", diff=0.05, p_holm=1.0, p=None, mode="probe", seeds=(0.05, 0.04), seed_p_holm=None, se=0.02):
    from pretrain.evaluation.report import PRIMARY, SECONDARY, Comparison

    family = PRIMARY if b == "none" and mode == "probe" else SECONDARY
    return Comparison(
        mode,
        "t",
        a,
        b,
        diff,
        diff - 0.04,
        diff + 0.04,
        p=p_holm if p is None else p,
        p_holm=p_holm,
        family=family,
        se=se,
        replicates=2000,
        seed_diffs=list(seeds),
        seed_p=seed_p_holm,
        seed_p_holm=seed_p_holm,
    )


def _kinds(ab, table, found, pre) -> dict:
    """kind -> the data of each note of that kind."""
    from pretrain.evaluation.report import NOTE_KINDS, notes, render_note

    out = {}
    for kind, data in notes(ab, table, found, pre):
        assert kind in NOTE_KINDS and render_note(kind, data)  # every note has its wording
        out.setdefault(kind, []).append(data)
    return out


FLAT = [_cmp("mlm"), _cmp("span"), _cmp("mlm", "span")]
MLM_ABOVE = [_cmp("mlm", diff=0.1, p_holm=0.001), _cmp("span"), _cmp("mlm", "span", p_holm=0.01)]
ONLY_PAIR = [_cmp("mlm"), _cmp("span"), _cmp("mlm", "span", p_holm=0.01)]
FIVE = (0.05, 0.04, 0.06, 0.03, 0.05)

# kind -> two (ablation, table, comparisons, pretraining) situations and what tells their notes of that kind apart
# (None: no note of that kind)
SITUATIONS = {
    "scale": (
        (_ab(), _table(), FLAT, _pre(tokens=1e6)),
        (_ab(), _table(), FLAT, _pre(tokens=1e9)),
        lambda d: d and (d[0]["tokens"], d[0]["early"]),
    ),
    "cost": (
        (_ab(), _table(), FLAT, _pre(per_token={"mlm": 4e6, "span": 5e6})),
        (_ab(), _table(), FLAT, _pre(per_token={"mlm": 4e6, "span": 8e6})),
        lambda d: d and d[0]["relative"],
    ),
    "budget": (
        (_ab(kind="flops"), _table(), FLAT, _pre()),
        (_ab(kind="time"), _table(), FLAT, _pre()),
        lambda d: d[0]["kind"],
    ),
    "method": (
        (_ab(), _table(), FLAT, _pre()),
        (_ab(), _table(), FLAT[:2], _pre()),
        lambda d: {f: v["comparisons"] for f, v in d[0]["families"].items()},
    ),
    "few_seeds": (
        (_ab(seeds=2), _table(), FLAT, _pre()),
        (_ab(seeds=5), _table(), [_cmp("mlm", seeds=FIVE)], _pre()),
        lambda d: d and d[0]["seed_draws"],
    ),
    "task": (
        (_ab(), _table(), FLAT, _pre()),
        (_ab(), _table(), MLM_ABOVE, _pre()),
        lambda d: [i["a"] for i in d[0]["above"]],
    ),
    "uncorrected": (
        (_ab(), _table(), FLAT, _pre()),
        (_ab(), _table(), [_cmp("mlm", p=0.01, p_holm=0.2), *FLAT[1:]], _pre()),
        lambda d: d and [i["a"] for i in d[0]["items"]],
    ),
    "nothing_separates": (
        (_ab(), _table(), FLAT, _pre()),
        (_ab(), _table(), ONLY_PAIR, _pre()),
        lambda d: d and d[0]["comparisons"],
    ),
    "none_above_random": (
        (_ab(), _table(), ONLY_PAIR, _pre()),
        (_ab(), _table(), MLM_ABOVE, _pre()),
        lambda d: d and d[0]["pairs"],
    ),
    "pairs": (
        (_ab(), _table(), [_cmp("mlm", diff=0.1, p_holm=0.001), *FLAT[1:]], _pre()),
        (_ab(), _table(), ONLY_PAIR, _pre()),
        lambda d: [(i["a"], i["b"]) for i in d[0]["significant"]],
    ),
    "seeds_untested": (
        (_ab(), _table(), MLM_ABOVE, _pre()),
        (_ab(), _table(), [_cmp("mlm", diff=0.1, p_holm=0.001, seeds=(0.2, -0.01))], _pre()),
        lambda d: d and [i["seed_diffs"] for i in d[0]["items"]],
    ),
    "seed_level": (
        (_ab(seeds=5), _table(), [_cmp("mlm", diff=0.1, p_holm=0.001, seeds=FIVE, seed_p_holm=0.0625)], _pre()),
        (_ab(seeds=6), _table(), [_cmp("mlm", diff=0.1, p_holm=0.001, seeds=FIVE + (0.1,), seed_p_holm=0.03)], _pre()),
        lambda d: d and ([i["a"] for i in d[0]["held"]], [i["a"] for i in d[0]["not_held"]]),
    ),
    "detectable": (
        (_ab(), _table(), FLAT, _pre()),
        (_ab(), _table(), [_cmp("mlm", se=0.01), _cmp("span", se=0.01), FLAT[2]], _pre()),
        lambda d: d[0]["items"][0]["mde"],
    ),
    "rtd_auc": (
        (_ab(), _table(), FLAT, _pre(per_token={"mlm": 4e6, "rtd": 5e6}, auc=0.53)),
        (_ab(), _table(), FLAT, _pre(per_token={"mlm": 4e6, "rtd": 5e6}, auc=0.8)),
        lambda d: d and d[0]["auc"],
    ),
    "probe": (
        (_ab(), _table(), FLAT, _pre()),
        (_ab(("probe", "full")), _table(("probe", "full")), FLAT, _pre()),
        lambda d: (d[0]["full_above"], d[0]["cells"]),
    ),
    "loss_levels": (
        (_ab(), _table(), FLAT, _pre(per_token={"mlm": 4e6, "span": 5e6})),
        (_ab(), _table(), FLAT, _pre(per_token={"mlm": 4e6})),
        lambda d: d and d[0]["objectives"],
    ),
}


def test_every_kind_of_note_is_tested():
    from pretrain.evaluation.report import NOTE_KINDS
    from pretrain.evaluation.report_render import WORDING

    assert set(SITUATIONS) == set(NOTE_KINDS) == set(WORDING)


@pytest.mark.parametrize("kind", list(SITUATIONS))
def test_each_note_changes_with_the_numbers(kind):
    one, other, key = SITUATIONS[kind]
    first, second = _kinds(*one).get(kind), _kinds(*other).get(kind)
    assert first or second, f"no '{kind}' note in either situation"
    assert key(first) != key(second)


def test_reference_token_counts():
    from pretrain.evaluation.report import BERT_BASE_TOKENS, ELECTRA_SMALL_TOKENS

    # BERT-base: 256 x (0.9M x 128 + 0.1M x 512) = 4.26e10; ELECTRA-Small: 1M x 128 x 128 = 1.64e10
    assert BERT_BASE_TOKENS == pytest.approx(4.26e10, rel=1e-3) and ELECTRA_SMALL_TOKENS == pytest.approx(1.64e10, 1e-3)
    (scale,) = _kinds(_ab(), _table(), FLAT, _pre(tokens=4.26e8))["scale"]
    assert scale["bert_base"] == pytest.approx(0.01, rel=1e-3) and not scale["early"]  # 2.6% of ELECTRA-Small's
    assert _kinds(_ab(), _table(), FLAT, _pre(tokens=1e8))["scale"][0]["early"]  # 0.6%: the first phase


def test_notes_never_contradict_each_other():
    """Random situations: the note that nothing separates appears exactly when nothing is significant, never beside
    a significant pair or task; a probe-only report says nothing of fine-tuning."""
    import random

    from pretrain.evaluation.report import render_note

    rng = random.Random(0)
    for _ in range(300):
        modes = rng.choice([("probe",), ("probe", "full")])
        seeds = rng.choice([1, 2, 3, 5, 6])
        found = []
        for mode in modes:
            for a, b in (("mlm", "none"), ("span", "none"), ("mlm", "span")):
                p_holm = rng.choice([0.001, 0.03, 0.2, 1.0])
                seed_p = rng.choice([0.01, 0.3]) if seeds >= 3 else None
                diffs = tuple(rng.uniform(-0.1, 0.1) for _ in range(seeds))
                found.append(
                    _cmp(a, b, rng.choice([-0.1, 0.1]), p_holm, rng.choice([p_holm, 0.01]), mode, diffs, seed_p)
                )
        kinds = _kinds(_ab(modes, seeds), _table(modes), found, _pre())
        significant = any(c.significant or c.holds_across_seeds for c in found)
        assert ("nothing_separates" in kinds) == (not significant)
        assert not ("nothing_separates" in kinds and "none_above_random" in kinds)
        if "nothing_separates" in kinds or "none_above_random" in kinds:
            assert not any(t["above"] for t in kinds["task"])
        if "nothing_separates" in kinds:
            assert not any(t["below"] for t in kinds["task"]) and "pairs" not in kinds
        pairs = kinds.get("pairs", [{"significant": []}])[0]["significant"]
        assert bool(pairs) == any(c.significant for c in found if c.b != "none")
        assert ("few_seeds" in kinds) == (seeds < 5)
        assert not ("seeds_untested" in kinds and "seed_level" in kinds)
        text = " ".join(render_note(kind, d) for kind, ds in kinds.items() for d in ds)
        if modes == ("probe",):  # no note counts or names a fine-tuning cell, nor words one
            assert kinds["probe"][0]["cells"] == 0 and kinds["method"][0]["main"] == "probe"
            assert all(t["mode"] == "probe" for t in kinds["task"]) and "fine-tun" not in text.lower()
