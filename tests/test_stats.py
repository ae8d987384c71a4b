"""The paired statistics of the ablation report, against hand-computed and analytic cases: the bootstrap's p floor and
how it scales with the family, the exact sign-flip test across seeds, the primary and secondary families, the minimum
detectable effect, and the reproducibility record."""

import hashlib
import math

import numpy as np
import pytest

from pretrain.evaluation.stats import (
    ALPHA,
    _features,
    _from_sums,
    compare,
    holm,
    metric_batch,
    minimum_detectable_effect,
    norm_ppf,
    p_floor,
    paired_bootstrap,
    replicates_for,
    sign_flip_floor,
    sign_flip_test,
)


def right_with(rng, labels, accuracy, shape):
    """Binary predictions [*shape, N] right with probability `accuracy`, independently per example."""
    return np.where(rng.random((*shape, len(labels))) < accuracy, labels, 1 - labels)


# ---------------------------------------------------------------------------------------------- the bootstrap


@pytest.mark.parametrize("metric", ["accuracy", "mcc", "pearson"])
def test_summed_features_give_the_metric_of_a_resample(metric):
    """The bootstrap adds per-example terms weighted by how often each example was drawn: the same number as the
    metric of the resampled rows themselves."""
    rng = np.random.default_rng(3)
    n = 50
    if metric == "pearson":
        labels, preds = rng.normal(size=n), rng.normal(size=(2, 3, n))
    else:
        labels, preds = rng.integers(0, 2, n), rng.integers(0, 2, (2, 3, n))
    rows = rng.integers(0, n, n)
    counts = np.bincount(rows, minlength=n).astype(float)
    features = _features(metric, labels, preds)  # [N, S, P, K]
    summed = _from_sums(metric, np.tensordot(counts, features, axes=(0, 0)), n)
    assert summed == pytest.approx(metric_batch(metric, labels[rows], preds[..., rows]), abs=1e-9)


def chunk_counts(rng, gold, recall, shape):
    """Per-sentence [correct, predicted] chunk counts [*shape, N, 2]: each gold chunk found with probability `recall`,
    plus up to two spurious ones."""
    correct = rng.binomial(np.broadcast_to(gold, (*shape, len(gold))), recall)
    return np.stack([correct, correct + rng.integers(0, 3, (*shape, len(gold)))], -1)


def test_chunk_f1_is_resampled_by_sentence():
    """Chunk F1 pools chunks over the dev set (conlleval): a resample of sentences gives the F1 of their pooled
    counts, and a clearly better tagger is significant while a tagger against itself is not."""
    rng = np.random.default_rng(5)
    gold = rng.integers(0, 6, 80)
    preds = chunk_counts(rng, gold, 0.7, (2, 3))
    rows = rng.integers(0, len(gold), len(gold))
    summed = _from_sums(
        "chunk_f1",
        np.tensordot(np.bincount(rows, minlength=len(gold)), _features("chunk_f1", gold, preds), (0, 0)),
        len(gold),
    )
    c, p = preds[..., rows, 0].sum(-1), preds[..., rows, 1].sum(-1)
    assert summed == pytest.approx(2 * c / (p + gold[rows].sum()))
    better = chunk_counts(rng, gold, 0.95, (3, 3))
    assert paired_bootstrap("chunk_f1", gold, better, preds, replicates=2000)["p"] < 0.01
    assert paired_bootstrap("chunk_f1", gold, preds, preds, replicates=2000)["p"] == 1.0


def test_replicates_scale_with_the_family_and_keep_its_floor_at_a_tenth_of_alpha():
    assert replicates_for(1) == 2000  # never fewer than before
    for m in (45, 51, 90, 300):
        r = replicates_for(m)
        assert r >= 20 * m / ALPHA and m * p_floor(r) <= ALPHA / 10
    # the arithmetic: 2,000 replicates, 45 comparisons: the smallest adjusted p is exactly 0.045
    assert 45 * p_floor(2000) == pytest.approx(0.045, abs=5e-5) and 51 * p_floor(2000) > ALPHA


def test_a_clear_effect_is_significant_over_90_comparisons():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 1000)
    a, b = right_with(rng, y, 0.9, (2, 2)), right_with(rng, y, 0.6, (2, 2))  # a gap of ~0.3, as in the issue
    others = [0.5] * 89
    fixed = paired_bootstrap("accuracy", y, a, b, replicates=2000)
    assert fixed["p"] == pytest.approx(2 / 2001) and holm([fixed["p"], *others])[0] == pytest.approx(0.09, abs=1e-3)
    scaled = paired_bootstrap("accuracy", y, a, b, replicates=replicates_for(90))
    assert scaled["diff"] > 0.25 and scaled["low"] > 0.2
    adjusted = holm([scaled["p"], *others])[0]
    assert adjusted == pytest.approx(90 * 2 / (replicates_for(90) + 1)) and adjusted < ALPHA / 10


def test_bootstrap_standard_error_is_the_analytic_one():
    """Independent errors, one seed: the replicates' sd is sqrt(var(a_i - b_i) / n)."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 2000)
    ra, rb = rng.random(2000) < 0.8, rng.random(2000) < 0.7
    a, b = np.where(ra, y, 1 - y)[None, None], np.where(rb, y, 1 - y)[None, None]
    r = paired_bootstrap("accuracy", y, a, b, replicates=4000)
    assert r["se"] == pytest.approx(np.sqrt(np.var(ra.astype(float) - rb) / 2000), rel=0.06)


def test_the_bootstrap_pairs_arms_by_pretraining_seed():
    """Seeds differ a lot (a seed's data order lifts or sinks every arm trained on it) while arm a beats arm b by
    3 points on each: drawn apart, the seeds' spread swamped the gap (se ~0.09, p ~0.7); drawn together it cancels in
    the difference. A seed one arm lacks (its run failed) is drawn for that arm alone."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 2000)
    quality = [0.55, 0.75, 0.95]  # seed 7, 8, 9: how well a model of that seed does
    a = np.stack([right_with(rng, y, q, (1, 1))[0] for q in quality])  # [3, 1, N]
    b = a.copy()
    for s in range(3):  # b: a with 3% of the dev examples turned wrong
        flip = rng.choice(np.flatnonzero(a[s, 0] == y), 60, replace=False)
        b[s, 0, flip] = 1 - y[flip]
    paired = compare("accuracy", y, {"a": a, "b": b}, [("a", "b")], 4000, seeds={"a": [7, 8, 9], "b": [7, 8, 9]})
    r = paired[("a", "b")]
    assert r["diff"] == pytest.approx(0.03) and r["se"] < 0.01 and r["low"] > 0 and r["p"] < 0.01
    reordered = compare(
        "accuracy", y, {"a": a, "b": b[::-1]}, [("a", "b")], 4000, seeds={"a": [7, 8, 9], "b": [9, 8, 7]}
    )
    assert reordered[("a", "b")]["se"] == pytest.approx(r["se"], rel=0.1)  # paired by id, not by position
    # b without seed 9: its draws of 9 come from its own seeds; the interval widens but the test still runs
    partial = compare("accuracy", y, {"a": a, "b": b[:2]}, [("a", "b")], 2000, seeds={"a": [7, 8, 9], "b": [7, 8]})
    assert partial[("a", "b")]["se"] > r["se"]


def test_a_pairs_seed_draws_are_its_own_whatever_other_arms_exist():
    """A and B lack seed 3 (their runs failed), C has it. Seeds drawn from the union over the task's arms drew 3 for
    A and B too, each then replacing it by a seed of its own drawn alone: A vs B lost its pairing, and its interval
    depended on C. A pair now draws from its own seeds: the same numbers with or without C."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 1000)
    a = np.stack([right_with(rng, y, q, (1, 1))[0] for q in (0.82, 0.62)])  # a strong seed effect shared by A and B
    b = np.stack([right_with(rng, y, q, (1, 1))[0] for q in (0.80, 0.60)])
    c = np.stack([right_with(rng, y, 0.7, (1, 1))[0] for _ in range(3)])
    alone = compare("accuracy", y, {"A": a, "B": b}, [("A", "B")], 4000, seeds={"A": [1, 2], "B": [1, 2]})
    with_c = compare(
        "accuracy",
        y,
        {"A": a, "B": b, "C": c},
        [("A", "B"), ("A", "C")],
        4000,
        seeds={"A": [1, 2], "B": [1, 2], "C": [1, 2, 3]},
    )
    assert with_c[("A", "B")] == alone[("A", "B")]
    assert alone[("A", "B")]["se"] < 0.02  # paired by seed: the shared seed effect cancels


# ---------------------------------------------------------------------------------------------- across seeds


def test_sign_flip_test_exact_hand_computed():
    assert sign_flip_test([0.01, 0.02, 0.03, 0.04, 0.05]) == pytest.approx(2 / 32)  # 5 seeds, all positive
    assert sign_flip_test([-0.3, -0.1, -0.2]) == pytest.approx(2 / 8)  # two-sided: all negative alike
    # sums of +-3 +-1 +-1 +-2 at least 5 from zero: 3+1+1+2, 3+1-1+2, 3-1+1+2 and their negatives: 6 of 16
    assert sign_flip_test([3, 1, -1, 2]) == pytest.approx(6 / 16)
    # a zero difference has no sign to flip: +-1 +-1 reach 2 in 2 of 4, each twice over the zero's "signs"
    assert sign_flip_test([0, 1, 1]) == pytest.approx(4 / 8)
    assert sign_flip_test([0.2, -0.2]) == 1.0 and sign_flip_test([]) == 1.0
    assert sign_flip_floor(5) == 2 / 32 and sign_flip_floor(3) == 0.25


def test_sign_flip_test_monte_carlo_beyond_exact():
    d = np.linspace(0.01, 0.2, 20)  # 2^20 assignments: Monte Carlo, (k + 1) / (draws + 1)
    p = sign_flip_test(d, draws=20_000)
    assert 1 / 20_001 <= p < 1e-3
    mixed = np.array([1.0, -1.0] * 10)
    assert sign_flip_test(mixed, draws=20_000) > 0.9


def test_seed_level_test_pairs_arms_by_seed_not_by_position():
    from pretrain.evaluation.report import Cell, comparisons, seed_differences

    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 200)
    seeds = [11, 12, 13, 14, 15]
    # arm a is right on 70% + 2% x seed index of the examples, b on 60% + the same: a beats b by 0.1 on every seed
    a = np.stack([np.where(np.arange(200) < 140 + 4 * i, y, 1 - y)[None] for i in range(5)])
    b = np.stack([np.where(np.arange(200) < 120 + 4 * i, y, 1 - y)[None] for i in range(5)])
    ca = Cell("accuracy", y, a, seeds)
    cb = Cell("accuracy", y, b[::-1].copy(), seeds[::-1])  # b's runs listed in another order
    assert seed_differences(ca, cb) == pytest.approx([0.1] * 5)
    (c,) = comparisons({"probe": {"t": {"a": ca, "b": cb}}}, "probe", replicates=500)
    assert c.seed_diffs == pytest.approx([0.1] * 5) and c.seed_p == pytest.approx(2 / 32)
    assert c.seed_p_holm == pytest.approx(2 / 32) and not c.holds_across_seeds  # 5 seeds cannot reach 0.05
    two = comparisons({"probe": {"t": {"a": Cell("accuracy", y, a[:2]), "b": Cell("accuracy", y, b[:2])}}})
    assert two[0].seed_p is None and len(two[0].seed_diffs) == 2  # fewer than 3 seeds: no test across them


# ---------------------------------------------------------------------------------------------- families


def _cells(rng, y, accuracies: dict[str, float], seeds: int = 1) -> dict:
    from pretrain.evaluation.report import Cell

    return {arm: Cell("accuracy", y, right_with(rng, y, acc, (seeds, 1))) for arm, acc in accuracies.items()}


def test_a_family_reports_the_seed_test_it_made():
    """One run of mlm failed on t2: that comparison has 2 seeds and no test across them, the other has 3. The family's
    floor across seeds is that of the comparison tested (1 of 2), not "untested" beside a printed seed p."""
    from pretrain.evaluation.report import PRIMARY, Cell, comparisons, families

    rng = np.random.default_rng(6)
    y = rng.integers(0, 2, 300)
    table = {"probe": {}}
    for task, mlm_seeds in (("t1", 3), ("t2", 2)):
        mlm, none = right_with(rng, y, 0.9, (3, 1)), right_with(rng, y, 0.6, (3, 1))
        table["probe"][task] = {
            "mlm": Cell("accuracy", y, mlm[:mlm_seeds], [1, 2, 3][:mlm_seeds]),
            "none": Cell("accuracy", y, none, [1, 2, 3]),
        }
    found = comparisons(table, "probe", replicates=500)
    assert [c.seed_p is not None for c in found] == [True, False]
    fam = families(found, "probe")[PRIMARY]
    assert (fam["comparisons"], fam["seed_tested"], fam["seeds"]) == (2, 1, 3)
    assert fam["seed_floor"] == pytest.approx(found[0].seed_p_holm) == pytest.approx(2 / 8)


def test_seed_level_p_values_are_holm_corrected_within_their_family():
    """Two comparisons of one family tested across seeds: each seed p is Holm-adjusted over the family's seed tests
    (the smaller x2, the other at least that), and `holds_across_seeds` reads the adjusted one: at 0.03 raw, 0.06
    adjusted, it does not hold. A family with one seed test each left this untested (Holm of one p is that p)."""
    from pretrain.evaluation.report import PRIMARY, SECONDARY, Comparison, adjust

    found = [Comparison("full", "t1", "mlm", "none", 0.1, 0.05, 0.15, p=0.01, family=PRIMARY, seed_p=0.03)]
    found += [Comparison("full", "t2", "mlm", "none", 0.1, 0.05, 0.15, p=0.01, family=PRIMARY, seed_p=0.02)]
    found += [Comparison("full", "t3", "mlm", "none", 0.1, 0.05, 0.15, p=0.01, family=PRIMARY)]  # not seed-tested
    found += [Comparison("probe", "t1", "mlm", "span", 0.1, 0.05, 0.15, p=0.01, family=SECONDARY, seed_p=0.01)]
    adjust(found)
    assert [c.seed_p_holm for c in found[:2]] == pytest.approx([0.04, 0.04])  # 0.02 x 2; 0.03 x 1, raised to it
    assert found[2].seed_p_holm is None and found[3].seed_p_holm == pytest.approx(0.01)  # its own family of one
    assert [c.holds_across_seeds for c in found] == [True, True, False, True]
    found[0].seed_p, found[1].seed_p = 0.03, 0.03
    adjust(found)
    assert [c.seed_p_holm for c in found[:2]] == pytest.approx([0.06, 0.06])
    assert not found[0].holds_across_seeds and found[0].seed_p < 0.05  # raw p alone would have said it held


def test_primary_family_is_corrected_apart_from_the_secondary():
    from pretrain.evaluation.report import PRIMARY, SECONDARY, Comparison, adjust, comparisons, families

    # by hand: two primary comparisons, forty secondary ones
    found = [Comparison("full", "t", "mlm", "none", 0.1, 0.05, 0.15, p=0.02, family=PRIMARY)]
    found += [Comparison("full", "t", "span", "none", 0.0, -0.1, 0.1, p=0.5, family=PRIMARY)]
    found += [Comparison("probe", "t", f"x{i}", f"y{i}", 0.0, -0.1, 0.1, p=0.3, family=SECONDARY) for i in range(40)]
    adjust(found)
    assert found[0].p_holm == pytest.approx(0.04) and found[0].significant  # x2, not x42
    assert holm([c.p for c in found])[0] == pytest.approx(0.84)  # what one pooled family would have said
    assert all(c.p_holm == pytest.approx(0.3 * 40) or c.p_holm == 1.0 for c in found[2:])

    # from predictions: the main mode (full) is primary; adding a probe mode grows the secondary family only
    rng = np.random.default_rng(4)
    y = rng.integers(0, 2, 300)
    full = _cells(rng, y, {"mlm": 0.9, "span": 0.65, "none": 0.6})
    probe = _cells(rng, y, {"mlm": 0.7, "span": 0.6, "none": 0.6})
    alone = comparisons({"full": {"t": full}}, "full", replicates=3000)
    both = comparisons({"full": {"t": full}, "probe": {"t": probe}}, "full", replicates=3000)
    primary = [(c.a, c.p, c.p_holm) for c in both if c.family == PRIMARY]
    assert primary == [(c.a, c.p, c.p_holm) for c in alone if c.family == PRIMARY]
    assert {(c.mode, c.b == "none") for c in both if c.family == PRIMARY} == {("full", True)}
    assert {(c.mode, c.a, c.b) for c in both if c.family == SECONDARY} == {
        ("full", "mlm", "span"),
        ("probe", "mlm", "none"),
        ("probe", "span", "none"),
        ("probe", "mlm", "span"),
    }
    fams = families(both, "full")
    assert (fams[PRIMARY]["comparisons"], fams[SECONDARY]["comparisons"]) == (2, 4)
    for family in (PRIMARY, SECONDARY):
        members = [c for c in both if c.family == family]
        assert [c.p_holm for c in members] == pytest.approx(holm([c.p for c in members]))


def test_report_comparisons_reach_significance_in_a_family_of_90():
    from pretrain.evaluation.report import SECONDARY, Cell, comparisons, families

    rng = np.random.default_rng(5)
    y = rng.integers(0, 2, 300)
    table = {"probe": {}}
    for task in ("t1", "t2"):  # 10 pretrained arms: 45 pairs per task; all but one predict alike
        best, rest = right_with(rng, y, 0.95, (1, 1)), right_with(rng, y, 0.6, (1, 1))
        arms = {"best": best, **{f"arm{i}": rest for i in range(9)}, "none": rest}
        table["probe"][task] = {arm: Cell("accuracy", y, preds) for arm, preds in arms.items()}
    found = comparisons(table, "probe")
    fams = families(found, "probe")
    assert fams[SECONDARY]["comparisons"] == 90 and fams[SECONDARY]["floor"] <= ALPHA / 10
    best = [c for c in found if c.family == SECONDARY and "best" in (c.a, c.b)]
    assert len(best) == 18 and all(c.significant for c in best)
    assert not any(c.significant for c in found if "best" not in (c.a, c.b))


# ---------------------------------------------------------------------------------------------- detectable effect


def test_norm_ppf_and_minimum_detectable_effect_analytic():
    for q in (1e-12, 0.001, 0.025, 0.2, 0.5, 0.8, 0.975, 1 - 0.05 / 180):
        assert 0.5 * math.erfc(-norm_ppf(q) / math.sqrt(2)) == pytest.approx(q, rel=1e-9)
    assert norm_ppf(0.975) == pytest.approx(1.959964, abs=1e-6) and norm_ppf(0.8) == pytest.approx(0.841621, abs=1e-6)
    assert minimum_detectable_effect(1.0) == pytest.approx(1.959964 + 0.841621, abs=1e-5)
    assert (
        minimum_detectable_effect(0.01, m=90) > minimum_detectable_effect(0.01, m=15) > minimum_detectable_effect(0.01)
    )
    with pytest.raises(ValueError):
        norm_ppf(1.0)


def test_minimum_detectable_effect_shrinks_with_the_dev_set():
    from pretrain.evaluation.report import comparisons, detectable, families

    rng = np.random.default_rng(6)
    mde = {}
    for n in (400, 1600):
        y = rng.integers(0, 2, n)
        table = {"probe": {"t": _cells(rng, y, {"mlm": 0.75, "none": 0.7}, seeds=1)}}
        found = comparisons(table, "probe", replicates=4000)
        (d,) = detectable(table, found, families(found, "probe"), "probe")
        assert d["examples"] == n and d["m"] == 1
        mde[n] = d["mde"]
    assert mde[1600] / mde[400] == pytest.approx(0.5, rel=0.15)  # 1 / sqrt(4)
    # and it is the formula: (z_{1 - alpha/2} + z_{0.8}) x se, se ~ sqrt(var(d_i) / n) ~ sqrt(0.55 / 400)
    assert mde[400] == pytest.approx(2.8016 * math.sqrt(0.55 / 400), rel=0.15)


# ---------------------------------------------------------------------------------------------- provenance


def test_provenance_records_code_versions_command_configs_and_hashes(tmp_path):
    from pretrain.core.provenance import collect, hash_paths, summary, write_provenance

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n')
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    (shards / "manifest.json").write_text("{}")
    (shards / "sub" / "0.bin").write_bytes(b"\x00\x01")
    (shards / ".lock").write_text("")  # hidden: a lock, not an input
    record = collect(
        ["pretrain", "train", "x.yaml"],
        {"run": {"train": {"seed": 1}}},
        {"corpus": [str(corpus)], "shards": shards, "tasks": [str(tmp_path / "nowhere")]},
    )
    assert len(record["git"]["commit"]) == 40 and isinstance(record["git"]["dirty"], bool)
    assert {"torch", "transformers", "tokenizers", "datasets", "deepspeed"} <= set(record["versions"])
    assert record["versions"]["torch"] and record["command"] == "pretrain train x.yaml"
    assert record["configs"] == {"run": {"train": {"seed": 1}}}
    assert record["sha256"]["corpus"] == {str(corpus): hashlib.sha256(corpus.read_bytes()).hexdigest()}
    assert set(record["sha256"]["shards"]) == {str(shards / "manifest.json"), str(shards / "sub" / "0.bin")}
    assert record["sha256"]["tasks"] == {str(tmp_path / "nowhere"): "missing"}
    assert hash_paths(str(tmp_path / "*.jsonl")) == record["sha256"]["corpus"]  # patterns, as corpus lists allow
    corpus.write_text("changed\n")
    assert hash_paths([corpus])[str(corpus)] == hashlib.sha256(b"changed\n").hexdigest()  # not a stale cache
    path = write_provenance(tmp_path / "run" / "provenance.json", record)
    assert path.is_file() and "commit " in summary(record) and "4 input file(s)" in summary(record)


def test_run_provenance_from_a_run_config(tmp_path):
    from pretrain.core.config import read_config
    from pretrain.core.provenance import run_provenance

    cfg = read_config("tiny.yaml", [f"output_dir={tmp_path}", "name=r"])
    record = run_provenance(cfg, "pretrain train tiny.yaml")
    assert record["configs"]["run"]["name"] == "r" and set(record["sha256"]) == {"corpus", "tokenizer", "shards"}
    assert record["sha256"]["tokenizer"] == {str(cfg.tokenizer_dir): "missing"}  # not built yet: said, not raised


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
    # a replicate tied with zero counts as beyond it (conservative): 10 ties and 90 above of 100 is p = 2 x 11 / 101
    from pretrain.evaluation.stats import summarize

    assert summarize(0.01, np.array([0.0] * 10 + [0.01] * 90))["p"] == pytest.approx(2 * 11 / 101)
    assert summarize(-0.01, np.array([0.0] * 10 + [-0.01] * 90))["p"] == pytest.approx(2 * 11 / 101)
