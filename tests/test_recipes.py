"""Every recipe in configs/ runs end to end with `pretrain run` (tokenizer, shards, DeepSpeed training, export)
and overfits a tiny repeated corpus: its loss falls well below where it started."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.train.distributed import single_process_env

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
RECIPES = ["bert", "roberta", "spanbert", "albert-style", "electra", "plm"]


@pytest.fixture(scope="module")
def repeated_corpus(tmp_path_factory):
    """The opening sentences of two real speeches, repeated 30 times: small enough to memorise in 200 steps,
    with two documents of several sentences for segment pairs."""
    docs = []
    for line in CORPUS.read_text().splitlines()[:2]:
        text = json.loads(line)["text"]
        docs.append(json.dumps({"text": ". ".join(text.split(". ")[:2]) + "."}))
    path = tmp_path_factory.mktemp("recipes") / "repeated.jsonl"
    path.write_text("\n".join(docs * 30) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_overfits_a_tiny_repeated_corpus(recipe, repeated_corpus, tmp_path):
    env = single_process_env(DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
    overrides = [
        f"output_dir={tmp_path}",
        f"name={recipe}",
        f"data.corpus=[{repeated_corpus}]",
        "data.vocab_size=1024",
        "data.max_seq_len=64",
        "data.num_workers=1",
        "model.hidden_size=64",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.intermediate_size=128",
        "model.max_position_embeddings=128",
        "model.hidden_dropout=0",
        "model.attention_dropout=0",
        "train.micro_batch_size=16",
        "train.max_steps=200",
        "train.max_minutes=0",
        "train.lr=3e-3",
        "train.warmup_steps=5",
        "train.log_every=1",
        "train.save_every=1000",
        "wandb.mode=disabled",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", "run", recipe, *overrides, "--no-demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / recipe / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-10:]) / 10
    assert last < 0.75 * first, (first, last, [r["loss"] for r in records])
    assert (tmp_path / recipe / "hf" / "config.json").is_file()
    if recipe == "plm":  # scored under BERT's masking, which its query-stream head never saw: the summary says so
        proc = subprocess.run(
            [sys.executable, "-m", "pretrain.cli", "eval", str(tmp_path / recipe), "--corpus", str(repeated_corpus)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "permutation-LM head scored under BERT's masking" in proc.stdout
