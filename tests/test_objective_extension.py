"""An objective added from outside the package touches only its module, its registration and its tests: this module
defines one (is a token's id even?), registers it, and trains it through the command line as a user would, the
CLI importing this module as a plugin ($PRETRAIN_PLUGINS). Its options' ranges are checked and shown like a
built-in objective's."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch.nn.functional as F
from torch import nn

from objectives import IGNORE_INDEX, Objective, ObjectiveOptions, ObjectiveOutput, build_objectives, option, register
from objectives.base import PLUGINS_ENV, flat_targets
from pretrain.core.errors import ConfigError
from pretrain.core.measures import Mean

PLUGIN = "tests.test_objective_extension"  # this module, as the CLI's process imports it (PYTHONPATH = the repo)


@dataclass
class EvenOptions(ObjectiveOptions):
    fraction: float = option(1.0, "Fraction of the non-special tokens whose parity is predicted.", gt=0, le=1)


@register
class EvenToken(Objective):
    """Predict whether each token's id is even, from the encoder's state at that token (a per-token binary head)."""

    name = "even"
    Options = EvenOptions
    # even_labels pads with -100 by its name (the *labels rule): nothing else to declare in pad_values

    def prepare(self, sample, rng):
        ids = sample["input_ids"]  # [n]
        labels = (ids % 2 == 0).astype(np.int64)  # [n] 1 where the id is even
        labels[np.isin(ids, self.tokens.special_ids)] = IGNORE_INDEX
        labels[rng.random(len(ids)) >= self.options.fraction] = IGNORE_INDEX
        sample["even_labels"] = labels
        return sample

    def collate(self, arrays):
        positions, targets = flat_targets(arrays["even_labels"])  # [M] into [B * L], [M]
        return {"even_positions": positions, "even_targets": targets}

    def target_counts(self, arrays):
        return {self.name: len(arrays["even_positions"])}

    def build_head(self, model_config, encoder):
        return nn.Linear(model_config.hidden_size, 1)

    def loss(self, batch, forward, model, weights):
        hidden = forward.hidden  # [B, L, H]
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["even_positions"])  # [M, H]
        logits = model.heads[self.name](rows).squeeze(-1).float()  # [M]
        targets = batch["even_targets"].float()  # [M]
        total = F.binary_cross_entropy_with_logits(logits, targets, reduction="sum")
        n = targets.shape[0]
        correct = ((logits > 0).float() == targets).sum()
        return ObjectiveOutput(
            total * weights(self.name), {"loss": Mean(total.detach(), n), "accuracy": Mean(correct, n)}
        )


def test_an_objective_from_outside_the_package_trains_through_the_cli(tmp_path, monkeypatch):
    # helpers here, not at the top: the CLI's process imports this module as a plugin, without tests/ on its path
    from helpers import run_args, run_cli, small_corpus

    monkeypatch.setenv(PLUGINS_ENV, PLUGIN)
    corpus, tokenizer, shards = small_corpus(tmp_path), tmp_path / "tokenizer", tmp_path / "shards"
    # `pretrain train` trains only (`pretrain run` would also export, and HF has no head for this objective)
    run_cli("tokenizer", corpus, "--out", tokenizer, "--vocab-size", "512", cwd=tmp_path)
    run_cli("shards", corpus, "--tokenizer", tokenizer, "--out", shards, cwd=tmp_path)
    overrides = [
        f"data.tokenizer={tokenizer}",
        f"data.shards={shards}",
        "objectives={even: {}}",
        "train.max_steps=20",
        "train.save_every=20",
        "train.lr=3e-3",
    ]
    run_cli("train", *run_args(tmp_path, corpus, *overrides), cwd=tmp_path)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["even/loss"] for r in records if "even/loss" in r]
    assert len(losses) == 20, records[-1]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:3]) / 3, losses
    # the plugin's code is outside the checkout's commit: the run's record names it with its hash
    plugins = json.loads((tmp_path / "r" / "provenance.json").read_text())["plugins"]
    (file, digest), *_ = plugins[PLUGIN].items()
    assert file.endswith("tests/test_objective_extension.py") and len(digest) == 64


def test_the_listing_shows_an_added_objective_with_its_range(tmp_path, monkeypatch):
    from helpers import run_cli

    monkeypatch.setenv(PLUGINS_ENV, PLUGIN)
    out = run_cli("objectives", cwd=tmp_path).stdout
    assert "even: " in out and "objectives.even.fraction = 1.0 (in (0, 1])" in out, out
    # each summary is its doc's first paragraph, whole (span's was cut at the end of its first line)
    assert "plus its position in the span (span boundary objective)." in out


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"even": {"fraction": 0.0}}, r"objectives\.even\.fraction: must be in \(0, 1\], got 0\.0"),
        ({"even": {"weight": -1}}, r"objectives\.even\.weight: must be >= 0, got -1"),
        ({"mlm": {"mask_prob": 1.0}}, r"objectives\.mlm\.mask_prob: must be in \(0, 1\), got 1\.0"),
    ],
)
def test_an_option_out_of_its_range_names_objective_option_and_range(spec, message, tokens):
    with pytest.raises(ConfigError, match=message):
        build_objectives(spec, tokens)


def test_ranges_are_declared_per_objective(tokens):
    (rtd,) = build_objectives({"rtd": {"mask_prob": 1.0}}, tokens)  # rtd declares (0, 1]: every token may be chosen
    assert rtd.options.mask_prob == 1.0


def test_the_mix_is_checked_with_the_registry_s_names(tokens):
    with pytest.raises(ConfigError, match="mlm and plm both rewrite the input tokens; choose one of mlm, ") as err:
        build_objectives({"mlm": {}, "even": {}, "plm": {}}, tokens)
    assert "even" not in str(err.value)  # it rewrites no input: not among the choices
