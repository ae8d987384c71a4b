"""Our ELECTRA against transformers' (ElectraForMaskedLM + ElectraForPreTraining, shared embeddings, tied generator
head), through `benchmarks/rtd_reference.py` as a user runs it, at a tiny scale on the embedded corpus.

1. Identical inputs (the reference copied from our initial weights, fed our sampled tokens, no dropout): the step-0
   losses, logits and every gradient agree to float rounding, and so do 40 steps of curves. Measured: at most
   1.2e-6 on any logged metric (fp32 summation order). The tolerance, 1e-4, is ~100x that drift; a real difference
   (a label, a loss weight, an untied or unshared tensor, a wrong gradient path) moves these curves by 1e-2 or more
   within a few steps.
2. Each side samples its own replacements (the reference with ELECTRA's Gumbel-max): the curves differ by sampling
   noise only. Each logged value averages 10 steps of 16 x 64 tokens (~1,500 masked, ~10,000 real tokens); the
   binomial standard error of a rate there is <= 0.013 for the generator's and <= 0.004 for the discriminator's, and
   the AUC's about 0.02. Tolerances are ~3 standard errors; measured differences were 3-10x below them.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.train.distributed import single_process_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "rtd_reference.py"
TINY = ["--hidden", "64", "--layers", "2", "--heads", "1", "--inter", "256", "--batch", "16", "--seq", "64"]
TINY += ["--steps", "40", "--log-every", "10", "--threads", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import train_tokenizer

    work = tmp_path_factory.mktemp("rtd-reference")
    corpus = ROOT / "data" / "us-speeches.public-domain.jsonl"
    train_tokenizer([corpus], work / "tok", vocab_size=512, show_progress=False)
    build_shards([corpus], work / "tok", work / "shards", num_workers=0, show_progress=False)
    return work


def compare(data: Path, out: Path, *options: str) -> tuple[dict, list[dict]]:
    env = single_process_env(WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(SCRIPT), "--tokenizer", str(data / "tok"), "--shards", str(data / "shards")]
    proc = subprocess.run([*cmd, "--out", str(out), *TINY, *options], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max |ours - ref|" in proc.stdout  # the table a user reads
    curves = [json.loads(line) for line in (out / "curves.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curves] == [10, 20, 30, 40] and (out / "curves.png").is_file()
    return json.loads((out / "summary.json").read_text()), curves


def test_identical_inputs_give_the_same_step_and_the_same_curves(data, tmp_path):
    summary, curves = compare(data, tmp_path, "--check", "--copy-init", "--ref-sampler", "ours", "--dropout", "0")
    check = summary["check"]
    assert check["ok"] and check["labels_equal"] and not check["grad_unmatched"]
    assert check["grad_tensors_compared"] >= 40  # every tensor of both models, shared embeddings included
    assert check["loss_rel_diff"] < 1e-6 and check["grad_max_rel_diff"] < 1e-5
    assert check["disc_logits_max_abs_diff"] < 1e-6
    for metric, diff in summary["max_abs_diff"].items():
        assert diff < 1e-4, (metric, diff)
    # the run trained: the loss fell, the discriminator reached the base rate (accuracy = 1 - replaced fraction)
    first, last = curves[0]["ours"], curves[-1]["ours"]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["disc_acc"] == pytest.approx(1 - last["replaced_fraction"], abs=0.01)


def test_independent_samples_give_curves_within_sampling_noise(data, tmp_path):
    summary, curves = compare(data, tmp_path, "--copy-init", "--ref-sampler", "gumbel", "--dropout", "0")
    tolerance = {"disc_loss": 0.012, "disc_acc": 0.012, "disc_auc": 0.06, "gen_acc": 0.04, "sampled_original": 0.04}
    for row in curves:
        for metric, tol in tolerance.items():
            assert abs(row["ours"][metric] - row["ref"][metric]) < tol, (row["step"], metric, row)
    # same data: the replaced fraction differs only where a sample happened to equal the original
    assert summary["max_abs_diff"]["replaced_fraction"] < 0.01
