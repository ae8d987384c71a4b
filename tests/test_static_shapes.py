"""What a compiled model sees of padded data (segment pairs, doc-bounded packing): with the collator's
`static_width` (the trainer sets it when the model is compiled) every batch has one length and one attention-mask
form, so the layers compile once; without it each new length, and a batch without padding, compiles again. The
heads and losses compile with them, each once: their graphs are dynamic in the number of targets. Dynamo's graphs
are counted through a backend that runs them as they are (no inductor: seconds, not minutes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import BASE, TOKENS, compile_with, make_batch

from objectives import build_objectives
from pretrain.model.pretraining import PretrainingModel

# Four rows each (the trainer's micro-batch is fixed): shorter rows, other lengths, then every row full.
LENGTHS = [(30, 17, 24, 9), (12, 20, 5, 31), (32, 32, 32, 32)]


@pytest.fixture
def graphs(monkeypatch):
    """The graphs dynamo hands its backend while the model is compiled, by compiled function."""
    compiled = {}

    def make(fn, mode):
        def backend(gm, example_inputs):
            compiled.setdefault(fn.__name__, []).append(gm)
            return gm.forward

        return torch.compile(fn, backend=backend)

    compile_with(monkeypatch, make)
    yield compiled
    torch._dynamo.reset()


def counts(graphs: dict) -> dict[str, int]:
    return {name: len(made) for name, made in graphs.items()}


LOCAL_ROPE = dict(norm_placement="pre", position_embedding="rope", local_attention=8, global_every=2)
ENCODER = {"_embed": 1, "layer_stack": 1}


@pytest.mark.parametrize(
    "options", [dict(), dict(unpadded=True), dict(LOCAL_ROPE, unpadded=True)], ids=["padded", "unpadded", "local"]
)
def test_a_static_width_compiles_the_model_once(graphs, options):
    model = PretrainingModel(replace(BASE, compile=True, **options), build_objectives({"mlm": {}}, TOKENS))
    masked = set()
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths, seed=seed, static_width=32)
        assert batch["input_ids"].shape == (4, 32) and batch.padded  # a full batch keeps its mask
        masked.add(batch.counts["mlm"])
        model(batch)[0].backward()
    # unpadded: the real tokens' count varies (80, 68, 128); the masked tokens' count varies in every case: each
    # graph is dynamic in them from the start
    assert len(masked) == len(LENGTHS)
    assert counts(graphs) == {**ENCODER, "_token_loss": 1}, {k: [g.graph for g in v] for k, v in graphs.items()}


@pytest.mark.parametrize(
    "spec, heads",
    [
        ({"mlm": {}, "nsp": {}}, {"_token_loss": 1, "_pair_loss": 1}),
        ({"span": {}}, {"_token_loss": 1, "_boundary_loss": 1}),
        ({"rtd": {"generator_layers": 1}}, {"_generate": 1, "_discriminator_loss": 1}),
    ],
    ids=["mlm+nsp", "span", "rtd"],
)
def test_each_objectives_head_and_loss_compile_once_with_the_encoder(graphs, spec, heads):
    """The heads and losses are compiled with the encoder, each once however many targets a batch has."""
    objectives = build_objectives(spec, TOKENS)
    model = PretrainingModel(replace(BASE, compile=True), objectives)
    targets = set()
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths, seed=seed, objectives=objectives, static_width=32)
        targets.add(tuple(batch.counts.values()))
        model(batch)[0].backward()
    assert len(targets) == len(LENGTHS)
    assert counts(graphs) == {**ENCODER, **heads}


def test_plm_query_stream_keeps_one_length_whatever_its_rows_targets(graphs):
    """PLM runs its query stream at each row's targets, T of them: T is a function of the static width alone (the
    most targets a row of that width can have), not of this batch's fullest row, so the layers (which carry the
    query stream) and the head compile once. It was the batch's most targets in a row: 5 here, then 3, then 5."""
    objectives = build_objectives({"plm": {}}, TOKENS)
    model = PretrainingModel(replace(BASE, compile=True), objectives)
    widths = set()
    for seed, lengths in enumerate([(32, 32, 32, 32), (12, 14, 16, 18), (20, 24, 26, 28)]):
        batch = make_batch(lengths, seed=seed, objectives=objectives, static_width=32)
        widths.add(batch["plm_query_positions"].shape)
        model(batch)[0].backward()
    assert counts(graphs) == {**ENCODER, "_token_loss": 1}
    assert widths == {(4, 6)}  # ceil(32 / K), K = 6


def test_fp8_unpadded_layers_compile_once_whatever_the_token_count_mod_16(graphs):
    """train.precision=fp8 pads a product's rows to a multiple of 16: in a compiled graph always (zero rows when
    there are none to add), so that the graph, dynamic in the real tokens T, is not guarded on T % 16. It was
    compiled again at the first batch whose T had the other remainder (80, then 68 real tokens here)."""
    from pretrain.model.fp8 import use_float8

    model = PretrainingModel(replace(BASE, compile=True, unpadded=True), build_objectives({"mlm": {}}, TOKENS))
    use_float8(model.encoder)
    tokens = []
    for seed, lengths in enumerate([(30, 17, 24, 9), (12, 20, 5, 31), (32, 32, 32, 32)]):
        batch = make_batch(lengths, seed=seed, static_width=32)
        tokens.append(batch.tokens % 16)
        model(batch)[0].backward()
    assert tokens == [0, 4, 0]
    assert counts(graphs) == {**ENCODER, "_token_loss": 1}


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


def test_the_compile_mode_reaches_torch_compile_once_per_function_and_mode(monkeypatch):
    """Each compiled function is made once per mode; a graph whose sizes vary records no CUDA graphs (the heads;
    the encoder too when unpadded)."""
    from pretrain.core.errors import ConfigError
    from pretrain.train.setup import load_config

    made = []
    compile_with(monkeypatch, lambda fn, mode: made.append((fn.__name__, mode)) or fn)  # runs eager
    for mode, unpadded in (
        ("reduce-overhead", False),
        ("reduce-overhead", False),
        ("default", False),
        ("max-autotune", True),
    ):
        cfg = replace(BASE, compile=True, compile_mode=mode, unpadded=unpadded)
        model = PretrainingModel(cfg, build_objectives({"mlm": {}}, TOKENS))
        model(make_batch())
    assert made == [
        ("_embed", "reduce-overhead"),
        ("layer_stack", "reduce-overhead"),
        ("_token_loss", "default"),
        ("_embed", "default"),
        ("layer_stack", "default"),
        ("_embed", "max-autotune-no-cudagraphs"),
        ("layer_stack", "max-autotune-no-cudagraphs"),
        ("_token_loss", "max-autotune-no-cudagraphs"),
    ]
    with pytest.raises(ConfigError, match="model.compile_mode: value 'cuda-graphs' is not one of default, reduce-"):
        load_config("tiny", ["model.compile_mode=cuda-graphs"])
