"""Config: presets, overrides, and errors that name the key, the value and the nearest valid key."""

import re
from pathlib import Path

import pytest
import torch._dynamo
import yaml

from pretrain.core.config import RunConfig, save_config
from pretrain.core.errors import ConfigError, UserError
from pretrain.core.parsing import describe_fields
from pretrain.train.setup import load_config


def test_preset_with_base_and_overrides():
    cfg = load_config("tiny", ["model.hidden_size=128", "train.lr=3e-4", "objectives.mlm.mask_prob=0.2"])
    assert cfg.model.hidden_size == 128 and cfg.model.num_layers == 2  # tiny overrides default.yaml
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.objectives["mlm"].mask_prob == pytest.approx(0.2)
    assert cfg.data.corpus == ["data/us-speeches.public-domain.jsonl"]  # inherited from default.yaml


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'model.hiden_size'.*did you mean 'hidden_size'"):
        load_config("tiny", ["model.hiden_size=128"])
    with pytest.raises(ConfigError, match=r"'objectives.mlm.mask_probability'.*'mask_prob'"):
        load_config("tiny", ["objectives.mlm.mask_probability=0.2"])
    with pytest.raises(ConfigError, match=r"unknown objective 'mlmm'.*'mlm'"):
        load_config("tiny", ["objectives.mlmm.weight=1"])


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"model.hidden_size: value 'big' is not a valid int"):
        load_config("tiny", ["model.hidden_size=big"])
    with pytest.raises(ConfigError, match=r"train.lr: value 'fast' is not a valid float"):
        load_config("tiny", ["train.lr=fast"])
    with pytest.raises(ConfigError, match=r"train.precision: value 'bf17' is not one of .*did you mean 'bf16'"):
        load_config("tiny", ["train.precision=bf17"])


def test_inconsistent_values():
    with pytest.raises(ConfigError, match="divisible"):
        load_config("tiny", ["model.hidden_size=66"])
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        load_config("tiny", ["data.max_seq_len=1024"])
    # both crashed only at the first forward
    with pytest.raises(ConfigError, match="= 9 per head: RoPE rotates pairs"):
        load_config("tiny", ["model.position_embedding=rope", "model.hidden_size=36", "model.num_heads=4"])
    with pytest.raises(ConfigError, match="model.embedding_size=32: the PLM query stream"):
        load_config("tiny", ["objectives={plm: {}}", "model.embedding_size=32"])
    # ZeRO hands the optimizer flat slices: LAMB's per-tensor trust ratio changed with the number of ranks
    for stage in (1, 2, 3):
        with pytest.raises(ConfigError, match=rf"train.optimizer=lamb: not with train.zero_stage={stage}"):
            load_config("tiny", ["train.optimizer=lamb", f"train.zero_stage={stage}"])
    assert load_config("tiny", ["train.optimizer=lamb"]).train.zero_stage == 0
    # an option of an objective the config does not train added it at weight 1 (sentence pairs, silently)
    with pytest.raises(ConfigError, match=r"objectives.sop.swap_prob=0.3: this config does not train sop \(mlm\)"):
        load_config("tiny", ["objectives.sop.swap_prob=0.3"])
    for named in (["objectives.sop.weight=1"], ["objectives.sop={}"], ["objectives={mlm: {}, sop: {}}"]):
        assert set(load_config("tiny", [*named, "objectives.sop.swap_prob=0.3"]).objectives) == {"mlm", "sop"}


def test_a_checkpoints_config_from_before_a_data_check_still_loads():
    """data.docs_per_shard=0 was read as 1 by older versions: refused in a new config, a run's saved one loads (to
    export or resume it)."""
    from pretrain.core.parsing import to_dict
    from pretrain.train.setup import config_from_dict

    with pytest.raises(ConfigError, match="data.docs_per_shard: must be >= 1, got 0"):
        load_config("tiny", ["data.docs_per_shard=0"])
    saved = to_dict(load_config("tiny"))
    saved["data"]["docs_per_shard"] = 0
    assert config_from_dict(saved).data.docs_per_shard == 0


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: 64\n  num_layers: [2\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: invalid YAML"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="not found"):
        load_config("no-such-preset")
    # a key or a base in a user's file: the file is named (it was not)
    typo = tmp_path / "typo.yaml"
    typo.write_text("base: tiny\nmodel: {hiden_size: 64}\n")
    with pytest.raises(ConfigError, match=rf"^{typo}: unknown config key 'model.hiden_size'"):
        load_config(str(typo))
    # ... but not for what it does not write: an override's value, or a key of the file it is based on
    five = tmp_path / "five.yaml"
    five.write_text("base: tiny\ntrain: {max_steps: 5}\n")
    with pytest.raises(ConfigError, match=r"^train.max_steps: must be >= 1, got 0"):
        load_config(str(five), ["train.max_steps=0"])
    # a section's mapping merges over the file's: a setting it does not name is still the file's, named
    (tmp_path / "minus.yaml").write_text("base: tiny\ntrain: {max_steps: -5}\n")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'minus.yaml'}: train.max_steps: must be >= 1, got -5"):
        load_config(str(tmp_path / "minus.yaml"), ["train={lr: 0.001}"])
    with pytest.raises(ConfigError, match=r"^train.max_steps: must be >= 1, got -3"):
        load_config(str(tmp_path / "minus.yaml"), ["train={max_steps: -3}"])
    # a key written in the file it is based on: that file is named (no file was), as a top-level key (no file)
    # and a check across two keys (the one the file wrote)
    (tmp_path / "top.yaml").write_text("base: typo.yaml\n")
    with pytest.raises(ConfigError, match=rf"^{typo}: unknown config key 'model.hiden_size'"):
        load_config(str(tmp_path / "top.yaml"))
    (tmp_path / "name.yaml").write_text("base: tiny\nnmae: x\n")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'name.yaml'}: unknown config key 'nmae'"):
        load_config(str(tmp_path / "name.yaml"))
    (tmp_path / "heads.yaml").write_text("base: tiny\nmodel: {num_heads: 3}\n")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'heads.yaml'}: model.hidden_size \(64\) must be divisible"):
        load_config(str(tmp_path / "heads.yaml"))
    (tmp_path / "b.yaml").write_text("base: tinyy\n")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'b.yaml'}: base: config 'tinyy' not found"):
        load_config(str(tmp_path / "b.yaml"))


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("tiny", ["train.max_steps=7"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["max_steps"] == 7


def test_every_field_is_documented():
    undocumented = [key for key, _, doc in describe_fields(RunConfig) if not doc]
    assert undocumented == []


def test_defects_that_used_to_crash_late_fail_when_read(tmp_path):
    loop = tmp_path / "a.yaml"
    loop.write_text("base: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"a\.yaml: base: presets inherit from each other in a loop .*b\.yaml"):
        load_config(str(loop))
    (tmp_path / "self.yaml").write_text("base: self.yaml\n")
    with pytest.raises(ConfigError, match="in a loop"):
        load_config(str(tmp_path / "self.yaml"))
    with pytest.raises(ConfigError, match=r"model.num_layers: must be >= 1, got 0"):
        load_config("tiny", ["model.num_layers=0"])
    for key, value, rule in (  # a torch traceback at the model's build, or NaN RoPE tables at the first step
        ("vocab_size", -5, ">= 0"),
        ("embedding_size", -5, ">= 0"),
        ("initializer_range", -1, ">= 0"),
        ("layer_norm_eps", -1, "> 0"),
        ("rope_theta", 0, "> 0"),
        ("type_vocab_size", 0, ">= 1"),
    ):
        with pytest.raises(ConfigError, match=rf"^model\.{key}: must be {rule}.*, got {value}"):
            load_config("tiny", [f"model.{key}={value}"])
    with pytest.raises(ConfigError, match=r"every weight is 0 \(mlm.weight=0\).*nothing"):
        load_config("tiny", ["objectives.mlm.weight=0"])
    with pytest.raises(ConfigError, match=r"train.log_every: must be >= 1"):
        load_config("tiny", ["train.log_every=0"])
    assert load_config("tiny", ["train.save_every=0"]).train.save_every == 0  # only the final checkpoint


def test_model_vocab_smaller_than_the_tokenizer_is_named():
    import numpy as np

    from pretrain.core.tokens import SpecialTokens
    from pretrain.train.setup import model_config_for

    tokens = SpecialTokens(0, 1, 2, 3, 4, vocab_size=1024, replaceable=np.arange(5, 1024))
    with pytest.raises(
        ConfigError,
        match=r"model.vocab_size \(512\) is smaller than the tokenizer's vocabulary "
        r"\(1024 tokens",
    ):
        model_config_for(load_config("tiny", ["model.vocab_size=512"]), tokens)
    assert model_config_for(load_config("tiny", ["model.vocab_size=2048"]), tokens).vocab_size == 2048


def test_resume_fingerprint_names_each_fixed_difference_and_the_override():
    from pretrain.core.errors import UserError
    from pretrain.train.fingerprint import changed_settings, check_resume, differences, fingerprint

    cfg = load_config("tiny")
    saved = fingerprint(cfg, cfg.model, "bf16", 2, "a" * 64, "b" * 64)
    # the same global batch on another split and number of ranks, and the free settings: no difference
    same = load_config(
        "tiny",
        ["train.micro_batch_size=4", "train.lr=1", "train.max_steps=9", "model.compile=true", "model.hidden_dropout=0"],
    )
    check_resume(saved, fingerprint(same, same.model, "bf16", 4, "a" * 64, "b" * 64), [], "ckpt")
    other = load_config("tiny", ["model.num_heads=2", "objectives.mlm.whole_word=true", "data.packing=doc_bounded"])
    current = fingerprint(other, other.model, "fp32", 2, "c" * 64, "b" * 64)
    with pytest.raises(UserError) as err:
        check_resume(saved, current, [], "ckpt")
    message = str(err.value)
    for needle in (
        "model.num_heads: 4 in the checkpoint, 2 now",
        "objectives.mlm.whole_word: False in the checkpoint",
        "data.packing: full_sentences",
        "train.precision: bf16",
        "tokenizer (sha256 of tokenizer.json): aaaaaaaaaaaa... in the checkpoint, cccccccccccc... now",
        "train.allow_changes=[data.packing,model.num_heads,objectives.mlm.whole_word,tokenizer,train.precision]",
    ):
        assert needle in message, (needle, message)
    check_resume(saved, current, ["model", "objectives", "data", "tokenizer", "train.precision"], "ckpt")
    # a checkpoint from before fingerprints recorded no data hash: not compared
    check_resume(
        {**saved, "data (content of the shards)": None},
        fingerprint(cfg, cfg.model, "bf16", 2, "a" * 64, "z" * 64),
        [],
        "ckpt",
    )
    with_sop = load_config("tiny", ["objectives.sop.weight=1"])
    assert ("objectives.sop.weight", "absent", 1.0) in differences(
        saved, fingerprint(with_sop, with_sop.model, "bf16", 2, "a" * 64, "b" * 64)
    )
    assert changed_settings(
        {"train": {"lr": 1.0, "allow_changes": []}, "name": "a"},
        {"train": {"lr": 2.0, "allow_changes": ["x"]}, "name": "b"},
    ) == ["train.lr: 1.0 -> 2.0"]


# ----------------------------------------------------------------------------------------------
# The typed-parsing API, for any config kind


def test_public_api_types_any_dataclass_tree(tmp_path):
    from dataclasses import dataclass, field
    from typing import Literal

    from pretrain.core.parsing import apply_overrides, doc, field_default, field_doc, from_dict, load_typed

    @dataclass(frozen=True)
    class Probe:
        mode: Literal["probe", "full"] = doc("probe", "What to train.")
        seeds: list[int] = doc(factory=lambda: [1, 2, 3], text="Seeds.")

    @dataclass(frozen=True)
    class Study:
        out: str = doc("", "Where.")
        probe: Probe = field(default_factory=Probe)

    assert from_dict(Study, {"probe": {"seeds": ["4"]}}) == Study(probe=Probe(seeds=[4]))
    with pytest.raises(ConfigError, match=r"^s\.yaml: unknown config key 'probe\.mdoe' \(did you mean 'mode'\?\)"):
        from_dict(Study, {"probe": {"mdoe": "full"}}, source="s.yaml")
    with pytest.raises(ConfigError, match=r"probe\.mode: value 'ful' is not one of probe, full \(did you mean 'full'"):
        from_dict(Study, {"probe": {"mode": "ful"}})
    with pytest.raises(ConfigError, match=r"probe: expected a mapping of Probe options"):
        from_dict(Study, {"probe": [1]})
    (tmp_path / "base.yaml").write_text("out: here\nprobe: {mode: full}\n")
    (tmp_path / "s.yaml").write_text("base: base.yaml\nprobe: {seeds: [7]}\n")
    assert load_typed(Study, tmp_path / "s.yaml", ["probe.seeds=[8, 9]"]) == Study("here", Probe("full", [8, 9]))
    given = {"a": {"b": 1}}
    assert apply_overrides(given, ["a.c=x", "a.b=2"]) == {"a": {"b": 2, "c": "x"}}
    assert given == {"a": {"b": 1}}  # a new dict: the caller's nested mappings as they were
    assert field_default(Probe, "seeds") == [1, 2, 3] and field_doc(Probe, "mode") == "What to train."
    with pytest.raises(KeyError, match="did you mean 'seeds'"):
        field_default(Probe, "seed")


def test_base_resolution_is_shared_by_every_config_kind(tmp_path):
    from pretrain.core.parsing import deep_merge, load_yaml_with_base, merge_base, nearest

    (tmp_path / "a.yaml").write_text("x: {p: 1, q: 2}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nx: {q: 3}\n")
    assert load_yaml_with_base(tmp_path / "b.yaml") == {"x": {"p": 1, "q": 3}}
    assert load_yaml_with_base(tmp_path / "b.yaml", replace=("x",)) == {"x": {"q": 3}}
    # a section of a file (an ablation's `run:` block) inheriting from a run preset
    run = merge_base({"base": "tiny", "train": {"lr": 1.0}}, tmp_path / "ablation.yaml")
    assert run["train"]["lr"] == 1.0 and run["model"]["num_layers"] == 2
    assert deep_merge({"a": {"b": 1}}, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}
    assert nearest("hiden", ["hidden", "heads"]) == " (did you mean 'hidden'?)"


def test_a_relative_base_is_found_beside_its_file_or_among_the_presets_never_in_the_current_directory(
    tmp_path, monkeypatch
):
    """`base: parent.yaml` not beside its file was taken from the current directory: the same config resolved to
    another base in another directory (and a user's ./tiny.yaml shadowed the preset `base: tiny.yaml`)."""
    from pretrain.core.parsing import load_yaml_with_base

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.yaml").write_text("base: parent.yaml\nname: c\n")
    (tmp_path / "parent.yaml").write_text("name: from-cwd\nx: 1\n")
    (tmp_path / "tiny.yaml").write_text("name: shadow\n")
    (tmp_path / "sub" / "d.yaml").write_text("base: tiny.yaml\n")
    monkeypatch.chdir(tmp_path)
    beside = re.escape(f"(a relative base is read beside its file: {tmp_path / 'sub' / 'parent.yaml'})")
    with pytest.raises(ConfigError, match=rf"c\.yaml: base: config 'parent\.yaml' not found.*{beside}"):
        load_yaml_with_base(tmp_path / "sub" / "c.yaml")
    assert load_yaml_with_base(tmp_path / "sub" / "d.yaml")["name"] == "tiny"  # the preset
    for bad in ("5", "[tiny]", "true"):
        (tmp_path / "e.yaml").write_text(f"base: {bad}\n")
        with pytest.raises(ConfigError, match=r"e\.yaml: base: expected a preset name or a file path, got"):
            load_yaml_with_base(tmp_path / "e.yaml")


def test_model_compile_unset_is_on_where_cuda_trains_and_an_explicit_choice_stands(monkeypatch):
    from pretrain.train.setup import compile_for_this_machine

    unset, off, on = (load_config("tiny", o) for o in ([], ["model.compile=false"], ["model.compile=true"]))
    zero3 = load_config("tiny", ["train.zero_stage=3"])
    assert unset.model.compile is None
    # dynamo's own patch restores suppress_errors (monkeypatch would delete it from dynamo's config)
    with torch._dynamo.config.patch(suppress_errors=False):
        for cuda in (False, True):
            monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
            assert compile_for_this_machine(off).model.compile is False
            assert compile_for_this_machine(on).model.compile is True
            assert not torch._dynamo.config.suppress_errors  # asked for: a compile error stops the run
            assert compile_for_this_machine(unset).model.compile is cuda
            assert torch._dynamo.config.suppress_errors is cuda  # by default: what torch cannot compile runs eager
            assert compile_for_this_machine(zero3).model.compile is False  # its parameter hooks stay eager
    assert not torch._dynamo.config.suppress_errors


def test_cuda_graphs_are_left_out_where_a_step_accumulates_micro_batches(capsys, monkeypatch):
    """A replayed backward graph writes each gradient into the memory the last micro-batch's is held in: a run that
    accumulates (by grad_accum_steps, or a global-batch ramp past one micro-batch per rank) compiles without them.
    On a CPU there are none to record: said, where torch ran the mode without them unsaid."""
    from pretrain.train.setup import compile_for_this_machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = compile_for_this_machine(load_config("tiny", ["model.compile=true", "model.compile_mode=reduce-overhead"]))
    assert cpu.model.compile_mode == "default"
    assert "model.compile_mode=reduce-overhead runs as default: CUDA graphs need a GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    graphs = ["model.compile=true", "model.compile_mode=reduce-overhead", "train.micro_batch_size=4"]
    one = load_config("tiny", graphs)
    assert compile_for_this_machine(one).model.compile_mode == "reduce-overhead"
    assert compile_for_this_machine(one, world=4).model.compile_mode == "reduce-overhead"
    assert capsys.readouterr().err == ""
    ramp_to_16 = "schedule.values=[{key: train.global_batch, points: [[0, 4], [10, 16]]}]"
    for extra in ("train.grad_accum_steps=2", ramp_to_16):
        accumulating = load_config("tiny", [*graphs, extra])
        assert compile_for_this_machine(accumulating).model.compile_mode == "default"
        assert "model.compile_mode=reduce-overhead runs as default" in capsys.readouterr().err
    # 16 sequences a step on 4 ranks of 4 are one micro-batch each: nothing accumulates
    ramp = load_config("tiny", [*graphs, ramp_to_16])
    assert compile_for_this_machine(ramp, world=4).model.compile_mode == "reduce-overhead"
    autotune = load_config("tiny", graphs[:1] + ["model.compile_mode=max-autotune", "train.grad_accum_steps=2"])
    assert compile_for_this_machine(autotune).model.compile_mode == "max-autotune-no-cudagraphs"
    eager = load_config("tiny", ["model.compile=false", *graphs[1:], "train.grad_accum_steps=2"])
    assert compile_for_this_machine(eager).model.compile_mode == "reduce-overhead"  # not compiled: nothing to say


@pytest.mark.parametrize("value", ["false", "no", "0", "[]", "''"])
def test_an_objective_given_false_or_zero_is_refused_not_trained_at_its_defaults(value):
    """`objectives.nsp=false` on bert (meant: without nsp) trained nsp at weight 1: a falsy value read as no options."""
    with pytest.raises(ConfigError, match=r"objectives\.nsp: expected a mapping of its options .* train without nsp"):
        load_config("bert", [f"objectives.nsp={value}"])
    # `nsp:` with nothing after it, as YAML writes an empty entry, is nsp at its defaults
    assert load_config("bert", ["objectives.nsp=null"]).objectives["nsp"].weight == 1.0


def test_a_section_given_as_a_mapping_is_merged_over_the_presets_as_a_base_is():
    """`train={lr: 0.5}` put every other train setting back at the code's default (tiny's 20 steps of 8 sequences
    became 1000 of 32), with no word; the objectives mapping is the one a preset, and an override, gives whole."""
    cfg = load_config("tiny", ["train={lr: 0.5, warmup_steps: 1}"])
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.micro_batch_size) == (0.5, 1, 20, 8)
    assert load_config("tiny", ["model={num_layers: 1}"]).model.hidden_size == 64  # tiny's, not the default 256
    assert set(load_config("albert-style", ["objectives={mlm: {}}"]).objectives) == {"mlm"}
    albert = load_config("albert-style", ["objectives.mlm={mask_prob: 0.2}"])  # those options: max_ngram's default
    assert (albert.objectives["mlm"].mask_prob, albert.objectives["mlm"].max_ngram) == (0.2, 1)


def test_text_yaml_1_1_reads_as_a_number_stays_the_text_written(tmp_path):
    """YAML 1.1 reads `010` as 8, `0x1F` as 31, `1_000` as 1000 and `2024-01-01` as a date: a run named 007 ran in
    runs/7, a source named 01 was '1', a dated name was refused as 'datetime.date(...) is not a valid str'."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "base: tiny\nname: '007'\nwandb: {project: 2024-01-01}\n"
        "data: {corpus: [], sources: [{name: 01, corpus: [a.jsonl]}, {name: 0x1F, corpus: [b.jsonl]}]}\n"
        "train: {max_steps: 010, save_every: 1_0, warmup_steps: 0x2}\n"
    )
    cfg = load_config(str(path), ["name=007", "data.text_field=1_000", "export_dir=+1"])
    assert (cfg.name, cfg.wandb.project, cfg.data.text_field, cfg.export_dir) == ("007", "2024-01-01", "1_000", "+1")
    assert [s.name for s in cfg.data.sources] == ["01", "0x1F"]
    # a number setting reads the text as a number: 010 is ten (YAML 1.2, and what a reader sees), not octal 8
    assert (cfg.train.max_steps, cfg.train.save_every, cfg.train.warmup_steps) == (10, 10, 2)
    with pytest.raises(ConfigError, match=r"train\.max_steps: value '1:30' is not a valid int"):  # not 90
        load_config("tiny", ["train.max_steps=1:30"])
    # and where it reads a boolean, the message says so
    with pytest.raises(ConfigError, match=r"wandb\.mode: value False is not a valid str: YAML reads an unquoted .*off"):
        load_config("tiny", ["wandb.mode=off"])
    assert load_config("tiny", ["wandb.mode='offline'", "name='no'"]).name == "no"
    # and a number with a fraction: a run named 1.10 ran as '1.1' (1e3 as '1000.0')
    with pytest.raises(ConfigError, match=r"name: value 1.1 is not a valid str: YAML reads an unquoted number"):
        load_config("tiny", ["name=1.10"])
    assert load_config("tiny", ["name='1.10'"]).name == "1.10"
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")) == cfg


def test_a_key_written_twice_in_a_file_is_refused_with_both_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second `train:` block further down dropped the first's settings."""
    path = tmp_path / "run.yaml"
    path.write_text("base: tiny\ntrain:\n  lr: 1.0e-3\n  max_steps: 5\nmodel: {num_layers: 1}\ntrain:\n  seed: 3\n")
    with pytest.raises(ConfigError, match=rf"^{path}:6: invalid YAML \(key 'train' is given twice, at lines 2 and 6"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"override value '\{lr: 1, lr: 2\}': key 'lr' is given twice"):
        load_config("tiny", ["train={lr: 1, lr: 2}"])
    # a merge key's entries are there to be overridden; an override given twice on the command line: the last
    path.write_text("base: tiny\nshared: &t {lr: 0.5, max_steps: 5}\ntrain:\n  <<: *t\n  lr: 0.1\n")
    from pretrain.core.parsing import load_yaml_with_base

    train = load_yaml_with_base(path)["train"]
    assert (train["lr"], train["max_steps"]) == (0.1, 5)
    assert load_config("tiny", ["train.lr=1", "train.lr=2"]).train.lr == 2.0


def test_an_override_of_a_list_item_and_a_far_key_say_what_to_do():
    """schedule.phases.1.start=5 said "expected a list, got {'1': ...}"; a key nothing resembles was given the
    nearest of all ('roberta' for 'parent.yaml')."""
    from pretrain.core.parsing import nearest

    with pytest.raises(ConfigError, match=r"schedule\.phases is a list, whose items cannot be set one by one; give"):
        load_config("bert-base-two-phase", ["schedule.phases.1.start=5"])
    assert nearest("parent.yaml", ["bert", "roberta", "albert"]) == ""
    assert nearest("hiden", ["hidden", "heads"]) == " (did you mean 'hidden'?)"


@pytest.mark.parametrize("name", ["../elsewhere", "/tmp/abs", "a/../../b", "."])
def test_a_run_name_that_leaves_output_dir_is_refused(name):
    """`name` is the run directory under output_dir: '../x' or an absolute path put the run outside it (where an
    ablation, `pretrain compare` and the docs' layout never look). A nested name stays within and is kept."""
    with pytest.raises(ConfigError, match=r"name: .* is the run directory under output_dir"):
        load_config("tiny", [f"name={name}"])
    assert load_config("tiny", ["name=group/run"]).run_dir == Path("runs") / "group" / "run"


@pytest.mark.parametrize("name", ["../outside", "/tmp/abs", "run/checkpoints/step_00000001", ".."])
def test_a_decay_name_is_a_name_beside_its_source(tmp_path, name):
    """`pretrain decay --name b/checkpoints/step_00000001` made a whole decay run, export and all, inside its source's
    checkpoints/, where the source's next rotation deleted it; '../x' and absolute paths wrote outside. Refused
    before anything is read."""
    from pretrain.train.branch import branch_for_decay

    with pytest.raises(UserError, match=r"--name .*: the branch's directory name, beside its source run"):
        branch_for_decay(tmp_path / "missing-run", steps=4, name=name)
    assert list(tmp_path.iterdir()) == []
