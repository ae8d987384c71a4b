"""What a compiled model sees of padded data (segment pairs, doc-bounded packing): with the collator's
`static_width` (the trainer sets it when the model is compiled) every batch has one length and one attention-mask
form, so the layers compile once; without it each new length, and a batch without padding, compiles again. Dynamo's
graphs are counted through a backend that runs them as they are (no inductor: seconds, not minutes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import BASE, TOKENS, make_batch

from objectives import build_objectives
from pretrain.model import encoder as encoder_module
from pretrain.model.pretraining import PretrainingModel

# Four rows each (the trainer's micro-batch is fixed): shorter rows, other lengths, then every row full.
LENGTHS = [(30, 17, 24, 9), (12, 20, 5, 31), (32, 32, 32, 32)]


@pytest.fixture
def graphs(monkeypatch):
    """The graphs dynamo hands its backend while the model's layers are compiled."""
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    torch._dynamo.reset()
    stack = torch.compile(encoder_module._layer_stack, backend=backend)
    monkeypatch.setattr(encoder_module, "_compiled", lambda mode: stack)
    yield compiled
    torch._dynamo.reset()


LOCAL_ROPE = dict(norm_placement="pre", position_embedding="rope", local_attention=8, global_every=2)


@pytest.mark.parametrize(
    "options", [dict(), dict(unpadded=True), dict(LOCAL_ROPE, unpadded=True)], ids=["padded", "unpadded", "local"]
)
def test_a_static_width_compiles_the_layers_once(graphs, options):
    model = PretrainingModel(replace(BASE, compile=True, **options), build_objectives({"mlm": {}}, TOKENS))
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths, seed=seed, static_width=32)
        assert batch["input_ids"].shape == (4, 32) and batch.padded  # a full batch keeps its mask
        model(batch)[0].backward()
    # unpadded: the real tokens' count varies (80, 68, 128); the one graph is dynamic in it from the start
    assert len(graphs) == 1, [g.graph for g in graphs]


def test_without_it_each_new_form_compiles_again(graphs):
    model = PretrainingModel(replace(BASE, compile=True), build_objectives({"mlm": {}}, TOKENS))
    for seed, lengths in enumerate(LENGTHS):
        model(make_batch(lengths, seed=seed))[0].backward()
    assert len(graphs) >= 3  # length 30, then another length, then no mask at all


@pytest.mark.parametrize(
    "overrides, compiled, width",
    [
        (["objectives={mlm: {}, nsp: {}}"], True, 64),  # segment pairs: rows end early
        (["data.packing=doc_bounded"], True, 64),
        ([], True, 0),  # packed rows fill the window: no mask, flash attention
        (["objectives={mlm: {}, nsp: {}}"], False, 0),  # eager: pad to the longest row only
    ],
)
def test_the_trainer_asks_for_a_static_width_where_a_compiled_model_reads_padded_rows(overrides, compiled, width):
    from pretrain.core.schedule import Schedule
    from pretrain.train.setup import load_config
    from pretrain.train.trainer import PhaseData

    cfg = load_config("tiny", overrides)  # data.max_seq_len 64
    objectives = build_objectives(cfg.objectives, TOKENS)
    schedule = Schedule.of(cfg)
    data = PhaseData(cfg, schedule, None, TOKENS, objectives)
    assert data.static_width(schedule.phases[0], compiled) == width


def test_the_compile_mode_reaches_torch_compile_once_per_mode(monkeypatch):
    from pretrain.core.errors import ConfigError
    from pretrain.train.setup import load_config

    made = []
    monkeypatch.setattr(encoder_module, "_compiled_layer_stacks", {})
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: made.append(mode) or fn)  # runs eager
    for mode in ("reduce-overhead", "reduce-overhead", "default"):
        model = PretrainingModel(replace(BASE, compile=True, compile_mode=mode), build_objectives({"mlm": {}}, TOKENS))
        model(make_batch())
    assert made == ["reduce-overhead", None]
    with pytest.raises(ConfigError, match="model.compile_mode: value 'cuda-graphs' is not one of default, reduce-"):
        load_config("tiny", ["model.compile_mode=cuda-graphs"])
