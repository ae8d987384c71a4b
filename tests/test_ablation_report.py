"""The ablation report: its notes follow the numbers, one kind of note per situation, never contradicting each other;
tasks in the config's order, a token task scored by chunk F1 beside a sentence task. On results made here, without
training (the runner's end-to-end test is in test_eval_ablation.py)."""

import json
from pathlib import Path

import pytest
from helpers import ROOT, make_pair_task


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
                "flops": 1e10 * (2 if arm.group == "span" else 1),  # as the plan's FLOPs per step
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
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.report import write_report

    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    ab = load_ablation(
        str(ROOT / "configs" / "ablation-tiny.yaml"), [task, f"output_dir={tmp_path / 'a'}", "seeds=[1, 2]"]
    )
    ab.out.mkdir(parents=True)
    clear = write_report(ab, _fake_results(ab, {"mlm": 0.9, "span": 0.6, "none": 0.6}))
    notes = _notes_of(clear)
    assert notes["budget"][0]["budget_kind"] == "tokens"  # saved under its own kind (the budget's overwrote it)
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
    for i, state in enumerate(worse.values()):
        state["host"] = {"device": "CPU: test (2 cores)", "torch": "2.x", "deepspeed": "0.y", "date": "2026-11-22"}
        state["host"] |= {"downstream_precision": "bf16 autocast" if i % 2 else "fp32"} if i else {}
    worse = write_report(ab, worse)
    notes = _notes_of(worse)
    assert [i["a"] for i in notes["task"][0]["below"]] == ["span"] and notes["task"][0]["same"] == ["mlm"]
    assert notes["none_above_random"][0]["below"] == 1 and "nothing_separates" not in notes
    run_on = next(line for line in worse.read_text().splitlines() if line.startswith("Run on: "))
    assert all(part in run_on for part in ("CPU: test (2 cores)", "torch 2.x", "DeepSpeed 0.y", "2026-11-22"))
    # arms fine-tuned on a GPU (bf16) and on a CPU (fp32) say so; the first arm, of an older version, says nothing
    assert run_on.endswith("2026-11-22; fine-tuning and probes in bf16 autocast and fp32.")


def test_failed_runs_count_in_no_pretraining_mean(tmp_path):
    """A run whose training failed records {plan, settings, failed} and no pretraining numbers: the arm's steps,
    tokens, FLOPs and wall time are the mean of its runs that trained (they averaged the failed one in as zeros, so
    the row and the budget note showed half the spent budget), and the row and the budget note say of how many."""
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.report import cells, notes, pretraining, render_note, write_report

    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    ab = load_ablation(
        str(ROOT / "configs" / "ablation-tiny.yaml"), [task, f"output_dir={tmp_path / 'a'}", "seeds=[1, 2]"]
    )
    ab.out.mkdir(parents=True)
    results = _fake_results(ab, {"mlm": 0.9, "span": 0.6, "none": 0.6})
    failed = results["span-seed2"]
    results["span-seed2"] = {"plan": failed["plan"], "settings": {}, "failed": "RuntimeError: out of memory"}
    pre = pretraining(ab, results)
    span = {k: pre["span"][k] for k in ("steps", "tokens", "flops", "wall_s")}
    assert span == {"steps": 10, "tokens": 5000, "flops": 2e10, "wall_s": 3.0}  # the trained run's, not halved
    assert pre["span"]["runs"] == 2 and pre["span"]["trained"] == 1
    assert pre["span"]["failed"] == "1 of 2 runs (totals: mean of the 1 trained): RuntimeError: out of memory"
    assert pre["mlm"]["trained"] == 2 and pre["mlm"]["failed"] is None and pre["none"]["trained"] == 2

    budget = dict(notes(ab, cells(ab, results), [], pre))["budget"]
    assert budget["spent"] == {"mlm": 1e10, "span": 2e10} and budget["partial"] == {"span": [1, 2]}
    text = write_report(ab, results).read_text()
    assert "| span | FAILED: 1 of 2 runs (totals: mean of the 1 trained): RuntimeError: out of memory | 10 |" in text
    assert "not all of an arm's runs: span 1 of 2." in render_note("budget", budget) in text
    budget["partial"] = {}
    assert "not all of an arm's runs" not in render_note("budget", budget)


def test_a_time_budget_says_which_arms_stopped_at_the_step_cap_with_minutes_left(tmp_path):
    """Under a time budget run.train.max_steps still caps each arm: a fast arm stopped there with minutes left, the
    arms did not get equal time, and the report said only that time on a shared machine is noisy."""
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.report import cells, notes, pretraining, render_note

    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    config = str(ROOT / "configs" / "ablation-tiny.yaml")
    ab = load_ablation(config, [task, f"output_dir={tmp_path / 'a'}", "budget={kind: time, amount: 1}"])
    results = _fake_results(ab, {"mlm": 0.9, "span": 0.6, "none": 0.6})  # every run 10 steps of a 10-step cap, 3 s
    results["span"]["pretraining"]["wall_s"] = 60.0  # span's ran out of minutes first
    budget = dict(notes(ab, cells(ab, results), [], pretraining(ab, results)))["budget"]
    assert budget["capped"] == {"mlm": [1, 1]} and budget["max_steps"] == ab.base.train.max_steps
    assert "stopped at the step cap" in render_note("budget", budget) and "mlm 1 of 1" in render_note("budget", budget)
    tokens = load_ablation(config, [task, f"output_dir={tmp_path / 'b'}"])
    assert "capped" not in dict(notes(tokens, cells(tokens, results), [], pretraining(tokens, results)))["budget"]


def test_flops_per_token_is_per_real_token_as_the_tokens_column(tmp_path):
    """A padded arm (sentence pairs) fills its token slots with fewer real tokens: per slot (the plan's FLOPs per step
    over its tokens per step) it looked cheaper than mlm while, at equal FLOPs, it trained on fewer real tokens, so the
    cost note and the budget note's "costs less per token trains on more tokens" contradicted the table."""
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.report import cells, notes, pretraining, render_note, write_report

    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    over = [task, f"output_dir={tmp_path / 'a'}", "seeds=[1, 2]", "budget={kind: flops, amount: 1e10}"]
    ab = load_ablation(str(ROOT / "configs" / "ablation-tiny.yaml"), over)
    ab.out.mkdir(parents=True)
    results = _fake_results(ab, {"mlm": 0.9, "span": 0.6, "none": 0.6})
    for arm in ab.arms:  # equal FLOPs; span 2% cheaper per slot, but 10% of its slots are padding
        state = results[arm.name]
        if arm.group == "span":
            state["plan"]["flops_per_step"] = 0.98e9
            state["pretraining"].update(tokens_seen=4500, flops=1e10)
    pre = pretraining(ab, results)
    assert pre["span"]["flops_per_token"] == pytest.approx(1e10 / 4500)
    assert pre["mlm"]["flops_per_token"] == pytest.approx(1e10 / 5000)
    found = dict(notes(ab, cells(ab, results), [], pre))
    assert found["cost"]["relative"] == {"span": pytest.approx(5000 / 4500)}  # costs more, trains on fewer
    cost, spent = found["cost"]["relative"]["span"], found["budget"]["spent"]
    assert (cost > 1) == (spent["span"] < spent["mlm"])  # what the budget note says of them
    assert "per real (non-padding) token" in render_note("cost", found["cost"])
    rows = [line for line in write_report(ab, results).read_text().splitlines() if line.startswith("| span |")]
    row = rows[-1]  # the pretraining table's
    assert "| 4,500 | 1.00e10 | 2.22e6 |" in row  # tokens, FLOPs, FLOPs per token: the last is FLOPs / tokens


def test_report_scores_a_token_task_by_chunk_f1_beside_a_sentence_task(tmp_path):
    """A CoNLL task in an ablation: its cells are chunk F1 over sentences (pooled counts, as conlleval), compared and
    tested like any other task."""
    import numpy as np

    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.report import write_report

    chunks = tmp_path / "chunks"  # configured (a report shows the configured tasks); its results are made below
    chunks.mkdir()
    for split in ("train.txt", "dev.txt"):
        (chunks / split).write_text("He PRP B-NP\nran VBD B-VP\n")
    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}, {chunks}]"
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
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.report import cells

    tasks = [make_pair_task(tmp_path / name, 4, 2) for name in ("zeta", "alpha", "mid")]
    ab = load_ablation(str(ROOT / "configs" / "ablation-tiny.yaml"), [f"eval.tasks=[{', '.join(map(str, tasks))}]"])
    one = _fake_results(ab, {"mlm": 0.6, "span": 0.6, "none": 0.6})
    for state in one.values():
        (result,) = state["downstream"]["probe"].values()
        state["downstream"]["probe"] = {name: result for name in ("mid", "alpha", "zeta")}
    assert [list(tasks) for tasks in cells(ab, one).values()] == [["zeta", "alpha", "mid"]]


def test_runs_scored_on_different_dev_labels_are_not_compared(tmp_path):
    """Every pairing (by example, by seed) assumes one dev set: a run scored after the task's files changed would be
    compared against the first run's labels. The report refuses, naming the task and both runs."""
    from pretrain.core.errors import UserError
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.report import cells

    task = f"eval.tasks=[{make_pair_task(tmp_path / 't', 4, 2)}]"
    ab = load_ablation(str(ROOT / "configs" / "ablation-tiny.yaml"), [task, "seeds=[1, 2]"])
    results = _fake_results(ab, {"mlm": 0.8, "span": 0.6, "none": 0.6})
    assert set(cells(ab, results)["probe"]["t"]) == {"mlm", "span", "none"}
    changed = results["span-seed2"]["downstream"]["probe"]["t"]
    changed["dev_labels"] = [1 - y for y in changed["dev_labels"]]
    with pytest.raises(UserError, match=r"t \(probe\): runs mlm-seed1 and span-seed2 were scored on different dev"):
        cells(ab, results)


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
            "trained": 2,
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
        "trained": 2,
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


def _regression_table(diverged: bool) -> dict:
    """{probe: {"t": {arm: Cell}}} of a regression task scored by pearson; with `diverged`, mlm's second downstream
    seed predicted one NaN."""
    import numpy as np

    from pretrain.evaluation.report import Cell

    rng = np.random.default_rng(0)
    y = rng.normal(size=50)
    arms = {}
    for arm, noise in (("mlm", 0.5), ("span", 1.0), ("none", 2.0)):
        preds = (y + rng.normal(scale=noise, size=(1, 2, 50))).copy()  # [S, P, N]
        if diverged and arm == "mlm":
            preds[0, 1, 7] = np.nan
        arms[arm] = Cell("pearson", y, preds)
    return {"probe": {"t": arms}}


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
        lambda d: d[0]["budget_kind"],
    ),
    "method": (
        (_ab(), _table(), FLAT, _pre()),
        (_ab(), _table(), FLAT[:2], _pre()),
        lambda d: {f: v["comparisons"] for f, v in d[0]["families"].items()},
    ),
    "few_seeds": (
        (_ab(seeds=2), _table(), FLAT, _pre()),
        (_ab(seeds=6), _table(), [_cmp("mlm", seeds=FIVE + (0.1,))], _pre()),  # 1 comparison: 6 seeds suffice
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
    "diverged": (
        (_ab(), _regression_table(diverged=False), FLAT, _pre()),
        (_ab(), _regression_table(diverged=True), FLAT, _pre()),
        lambda d: d and [(i["arm"], i["runs"], i["of"]) for i in d[0]["items"]],
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


def test_a_diverged_regression_fine_tuning_is_scored_0_in_both_places_and_said(capsys):
    """One NaN prediction made a seed's pearson nan in the run's own record and 0 in the report, with no word."""
    import numpy as np

    from pretrain.evaluation.finetune import Task, task_metrics
    from pretrain.evaluation.report import render_note

    cell = _regression_table(diverged=True)["probe"]["t"]["mlm"]
    task = Task("t", "regression", False, [], ([], None, []), ([], None, list(cell.labels)))
    assert task_metrics(task, cell.preds[0, 1], cell.labels) == {"pearson": 0.0, "spearman": 0.0}
    assert "1 of 50 dev predictions are not finite (the fine-tuning diverged)" in capsys.readouterr().err
    scores = [task_metrics(task, p, cell.labels)["pearson"] for p in cell.preds[0]]
    assert cell.mean == pytest.approx(np.mean(scores))  # the report's score is the runs' own
    (note,) = _kinds(_ab(), _regression_table(diverged=True), FLAT, _pre())["diverged"]
    assert "mlm on t (probe): 1 of 2" in render_note("diverged", note)


def test_the_budget_note_with_no_run_trained_has_no_empty_list():
    """Every run failed: the note read "also used more compute (FLOPs: );"."""
    from pretrain.evaluation.report import render_note

    for kind in ("tokens", "flops"):
        text = render_note("budget", {"budget_kind": kind, "amount": 1e6, "spent": {}, "partial": {}})
        assert "()" not in text and ": )" not in text and "( " not in text


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
    from pretrain.evaluation.stats import ALPHA, sign_flip_floor

    rng = random.Random(0)
    for _ in range(300):
        modes = rng.choice([("probe",), ("probe", "full")])
        seeds = rng.choice([1, 2, 3, 5, 6, 7, 8])
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
        sizes = [v["comparisons"] for v in kinds["method"][0]["families"].values()]
        assert ("few_seeds" in kinds) == any(m * sign_flip_floor(seeds) >= ALPHA for m in sizes)
        assert not ("seeds_untested" in kinds and "seed_level" in kinds)
        text = " ".join(render_note(kind, d) for kind, ds in kinds.items() for d in ds)
        if modes == ("probe",):  # no note counts or names a fine-tuning cell, nor words one
            assert kinds["probe"][0]["cells"] == 0 and kinds["method"][0]["main"] == "probe"
            assert all(t["mode"] == "probe" for t in kinds["task"]) and "fine-tun" not in text.lower()


def test_few_seeds_says_the_seeds_each_family_needs():
    """A sign-flip test over n seeds cannot go below 2/2^n, and Holm multiplies that by the family's size m: the
    warning stands until m x 2/2^n < alpha and names that n (it was silent from 5 seeds, where 2/2^5 = 0.0625)."""
    from pretrain.evaluation.report import render_note
    from pretrain.evaluation.report_notes import few_seeds
    from pretrain.evaluation.stats import ALPHA, seeds_needed, sign_flip_floor

    for m, n in ((1, 6), (2, 7), (12, 9), (25, 10), (48, 11)):
        assert seeds_needed(m) == n and m * sign_flip_floor(n) < ALPHA <= m * sign_flip_floor(n - 1)
    assert seeds_needed(100_000) is None  # beyond what the Monte Carlo floor allows

    one = [_cmp("mlm", seeds=FIVE)]
    (warned,) = _kinds(_ab(seeds=5), _table(), one, _pre())["few_seeds"]
    assert (warned["needed"], warned["families"]) == (6, {"primary": {"comparisons": 1, "needed": 6}})
    text = render_note("few_seeds", warned)
    assert "6 or more" in text and "5 or more" not in text and "0.0625 (2/2^5)" in text
    assert "few_seeds" not in _kinds(_ab(seeds=6), _table(), [_cmp("mlm", seeds=FIVE + (0.1,))], _pre())

    fams = {"primary": {"comparisons": 12}, "secondary": {"comparisons": 48}}  # the GPU preset's families
    assert few_seeds(fams, 4)["needed"] == 11 and set(few_seeds(fams, 4)["families"]) == {"primary", "secondary"}
    assert few_seeds(fams, 9)["families"] == {"secondary": {"comparisons": 48, "needed": 11}}
    assert few_seeds(fams, 11) is None
    assert few_seeds({}, 5)["needed"] == 6 and few_seeds({}, 6) is None  # nothing compared: as one comparison
    huge = few_seeds({"secondary": {"comparisons": 100_000}}, 20)
    assert huge["needed"] is None and "smaller families" in render_note("few_seeds", huge)
    single = render_note("few_seeds", few_seeds(fams, 1))
    assert "11 or more" in single and "5 or more" not in single


def test_seed_notes_count_the_seeds_each_family_paired_up(tmp_path):
    """6 seeds per arm and the random encoder's 6th run failed: the comparisons with it pair up 5 seeds, the pairs of
    arms 6. The notes took the fewest of all for everything: "with 5 seeds per arm ... p cannot go below 0.0625",
    then listed a pair that held at p 0.031 across 6."""
    from pretrain.evaluation.report import render_note

    six = FIVE + (0.07,)
    found = [
        _cmp("mlm", diff=0.1, p_holm=0.001, seeds=FIVE, seed_p_holm=0.0625),
        _cmp("span", seeds=FIVE, seed_p_holm=1.0),
        _cmp("mlm", "span", diff=0.1, p_holm=0.001, seeds=six, seed_p_holm=0.031),
    ]
    kinds = _kinds(_ab(seeds=6), _table(), found, _pre())
    (few,) = kinds["few_seeds"]
    assert few["seeds"] == 6 and few["families"]["primary"] == {"comparisons": 2, "needed": 7, "seeds": 5}
    assert "pair up only 5 (runs failed or are missing)" in render_note("few_seeds", few)
    (level,) = kinds["seed_level"]
    assert (level["seeds"], level["fewest"]) == (6, 5) and [(i["a"], i["b"]) for i in level["held"]] == [
        ("mlm", "span")
    ]
    text = render_note("seed_level", level)
    assert "Across the 5 to 6 pretraining seeds" in text and "0.0312 with 6 seeds, 0.0625 with 5" in text
    # a significant comparison its failed runs left untested is said to be so, not listed as "does not hold"
    found[0] = _cmp("mlm", diff=0.1, p_holm=0.001, seeds=(0.1, 0.1))
    (level,) = _kinds(_ab(seeds=6), _table(), found, _pre())["seed_level"]
    assert [i["a"] for i in level["untested"]] == ["mlm"] and all(i["b"] == "span" for i in level["not_held"])
    assert "not tested (fewer than 3 seeds paired up" in render_note("seed_level", level)


def test_a_task_dropped_from_the_config_leaves_the_report(tmp_path):
    """Every run was scored on t and u; the config now lists t alone. u stayed in the table and, counted in the
    primary family, doubled Holm's m for t's comparisons."""
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.report import PRIMARY, cells, comparisons, families

    task = make_pair_task(tmp_path / "t", 4, 2)
    ab = load_ablation(str(ROOT / "configs" / "ablation-tiny.yaml"), [f"eval.tasks=[{task}]"])
    results = _fake_results(ab, {"mlm": 0.6, "span": 0.6, "none": 0.6})
    alone = comparisons(cells(ab, results), "probe", replicates=500)
    for state in results.values():
        state["downstream"]["probe"]["u"] = state["downstream"]["probe"]["t"]
    table = cells(ab, results)
    assert list(table["probe"]) == ["t"]
    found = comparisons(table, "probe", replicates=500)
    assert families(found, "probe")[PRIMARY]["comparisons"] == 2
    assert [(c.a, c.p_holm) for c in found] == [(c.a, c.p_holm) for c in alone]


def test_readme_says_holm_corrects_within_each_family():
    """README said the comparisons were Holm-corrected over all of them; `adjust` corrects within each family (the
    primary family's p of 0.02 stays 0.04 beside forty secondary comparisons, not 0.84)."""
    from pretrain.evaluation.report import PRIMARY, SECONDARY, Comparison, adjust
    from pretrain.evaluation.stats import seeds_needed

    found = [Comparison("full", "t", "mlm", "none", 0.1, 0.05, 0.15, p=0.02, family=PRIMARY)]
    found += [Comparison("full", "t", "span", "none", 0.0, -0.1, 0.1, p=0.5, family=PRIMARY)]
    found += [Comparison("probe", "t", f"x{i}", f"y{i}", 0.0, -0.1, 0.1, p=0.3, family=SECONDARY) for i in range(40)]
    adjust(found)
    assert found[0].p_holm == pytest.approx(0.04)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "Holm-corrected over all the report's comparisons" not in readme
    assert "Holm-corrected within each of two families" in readme
    assert f"({seeds_needed(1)} seeds for one comparison, {seeds_needed(12)} for 12)" in readme


def test_without_a_random_encoder_no_note_speaks_of_one():
    """An ablation with no `none` arm: the notes said nothing told "any arm from the random encoder" and gave the
    smallest gap "a comparison with the random encoder" could find, where there is none."""
    import numpy as np

    from pretrain.evaluation.report import Cell, comparisons, notes, render_note

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    table = {"probe": {"t": {a: Cell("accuracy", y, right_with(rng, y, 0.6)) for a in ("mlm", "span")}}}
    found = comparisons(table, "probe", 2000)
    texts = {kind: render_note(kind, d) for kind, d in notes(_ab(seeds=3), table, found, {})}
    assert {"nothing_separates", "detectable"} <= set(texts)
    assert "There is no random-encoder arm" in texts["method"]
    assert not [k for k, text in texts.items() if k != "method" and "random encoder" in text.lower()], texts
    assert "between pretrained arms" in texts["detectable"]

    table["probe"]["t"]["none"] = Cell("accuracy", y, right_with(rng, y, 0.6))  # with one, they say so
    found = comparisons(table, "probe", 2000)
    texts = {kind: render_note(kind, d) for kind, d in notes(_ab(seeds=3), table, found, {})}
    assert "nor any arm from the random encoder" in texts["nothing_separates"]
    assert "a comparison with the random encoder" in texts["detectable"]
    item = {"mode": "probe", "metric": "accuracy", "examples": 300, "mde": 0.1}  # `none` failed on task u alone
    mixed = [{**item, "task": "t", "family": "primary", "m": 2}, {**item, "task": "u", "family": "secondary", "m": 1}]
    text = render_note("detectable", {"items": mixed, "power": 0.8, "alpha": 0.05})
    assert "where a task has one, else between pretrained arms" in text and "m = 2" in text and "m = 1" in text


def right_with(rng, labels, accuracy):
    """[1, 1, N] predictions right on about `accuracy` of the examples."""
    import numpy as np

    return np.where(rng.random(len(labels)) < accuracy, labels, 1 - labels)[None, None]


def test_a_p_value_is_never_printed_on_the_other_side_of_alpha():
    """11 seeds, one comparison: a Holm-adjusted p of 102/2048 = 0.0498 holds, and printed as 'seeds p 0.05'."""
    from pretrain.evaluation.report_render import fmt_p

    assert fmt_p(102 / 2048) == "0.0498" and fmt_p(0.05) == "0.05" and fmt_p(0.0504) == "0.05"
    assert fmt_p(0.012345) == "0.012" and fmt_p(0.5) == "0.5" and fmt_p(1.0) == "1"
    assert fmt_p(520 / 10401) == "0.049995"  # 26 comparisons' 10,400 replicates: held, and read 0.05 at four digits
