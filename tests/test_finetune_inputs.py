"""What `pretrain finetune` reads and refuses before it trains: a task's TSV files (encoding, quoting, columns), the
task type a directory allows, the seeds, the model's positions and an existing classification head."""

from pathlib import Path

import pytest
from helpers import PAIR_WORDS, tiny_bert

from pretrain.core.errors import UserError
from pretrain.evaluation.finetune import finetune, load_task, read_tsv


def write_task(directory, train: str | bytes, dev: str | bytes | None = None):
    """train.tsv and dev.tsv (dev: train's text unless given); str written as UTF-8, bytes as they are."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, text in (("train", train), ("dev", train if dev is None else dev)):
        path = directory / f"{split}.tsv"
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text, encoding="utf-8")
    return directory


def test_a_file_not_in_utf8_names_file_and_line(tmp_path):
    task = write_task(tmp_path / "t", "sentence\tlabel\na b\t0\ncaf\xe9 c\t1\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"train\.tsv:3: byte 0xe9 is not UTF-8"):
        load_task(task)


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    task = write_task(tmp_path / "t", "\ufeffsentence\tlabel\na b\t0\nc d\t1\n")
    assert read_tsv(task / "train.tsv") == (["a b", "c d"], None, ["0", "1"])
    assert load_task(task).kind == "classification"


@pytest.mark.parametrize(
    "rows,message",
    [
        # a quoted field that runs on to a later line, tabs and all: the rows between would be one example
        (['"Hello world\t1\nother text"\t0', "fine\t1"], r"train\.tsv:2: a field holds a tab \(this row runs on"),
        (["a\t1", '"tab\tinside"\t0'], r"train\.tsv:3: a quoted field holds a tab, which a task's text may not"),
    ],
)
def test_a_field_swallowing_tabs_or_lines_is_refused_as_quoting(tmp_path, rows, message):
    task = write_task(tmp_path / "t", "\n".join(["sentence\tlabel", *rows, "last\t0"]) + "\n")
    with pytest.raises(UserError, match=message) as err:
        load_task(task)
    assert "quot" in str(err.value)
    # a quote inside a field, quotes around a whole field (lines and all), and a trailing tab are fine
    write_task(tmp_path / "t", 'sentence\tlabel\t\nsay "hi"\t1\n"quoted"\t0\n"two\nlines"\t1\t\n')
    assert load_task(tmp_path / "t").train[0] == ['say "hi"', "quoted", "two lines"]


def test_a_file_that_is_not_csv_quoted_keeps_its_quotes_as_glue_files_do(tmp_path, capsys):
    """GLUE's own TSVs are not CSV-quoted: '"Yes," she said.' was read as the quoted field 'Yes,', its quotes
    dropped with no word (and a quote never closed swallowed the rows after it). Such a file is read with every quote
    as text, and said; a CSV-quoted file is read as before."""
    rows = ['"Yes," she said.\t1', '"The Extra Girl" (1923) is a film\t0', '"Hello world\t1', "fine\t0"]
    task = write_task(tmp_path / "glue", "\n".join(["sentence\tlabel", *rows]) + "\n")
    assert load_task(task).train[0] == ['"Yes," she said.', '"The Extra Girl" (1923) is a film', '"Hello world', "fine"]
    assert "glue/train.tsv:2: text after a closing quote" in capsys.readouterr().err
    lines: list[int] = []
    assert read_tsv(task / "dev.tsv", lines)[2] == ["1", "0", "1", "0"] and lines == [2, 3, 4, 5]


def test_question_and_sentence_are_a_pair_and_other_columns_are_refused(tmp_path):
    qnli = write_task(tmp_path / "qnli", "index\tquestion\tsentence\tlabel\n0\tWho?\tHe did.\tyes\n1\tWhen?\tNo.\tno\n")
    task = load_task(qnli)
    assert task.pair and task.train[0] == ["Who?", "When?"] and task.train[1] == ["He did.", "No."]
    rte = write_task(tmp_path / "rte", "idx\tsentence1\tsentence2\tlabel\n0\ta\tb\t1\n1\tc\td\t0\n")
    assert load_task(rte).train[:2] == (["a", "c"], ["b", "d"])
    extra = write_task(tmp_path / "extra", "id\tsentence\tcontext\tlabel\n0\ta\tb\t1\n1\tc\td\t0\n")
    with pytest.raises(UserError, match=r"train\.tsv:1: column\(s\) \['context'\] .* are neither text nor label"):
        load_task(extra)


def test_task_type_token_asks_for_conll_files(tmp_path):
    task = write_task(tmp_path / "t", "sentence\tlabel\na b\t0\nc d\t1\n")
    with pytest.raises(UserError, match=r"--task-type token needs a CoNLL task: train\.txt and dev\.txt in that"):
        load_task(task, "token")
    # beside train.tsv, CoNLL files are read when the token type is asked for (auto reads the TSV)
    for split in ("train", "dev"):
        (task / f"{split}.txt").write_text("A DT B-NP\ndog NN I-NP\n\nruns VBZ B-VP\n")
    assert load_task(task, "token").kind == "token" and load_task(task).kind == "classification"


def test_a_seed_given_twice_is_refused(tmp_path, capsys):
    from pretrain.cli import main

    task = write_task(tmp_path / "t", "sentence\tlabel\na b\t0\nc d\t1\n")
    assert main(["finetune", str(tmp_path / "model"), str(task), "--seed-list", "1", "1", "1"]) == 2
    assert "seeds [1, 1, 1] repeat [1]: give each seed once" in capsys.readouterr().err
    # what was taken and then dropped with no word: --seeds beside --seed-list, a sweep's options with no sweep
    with pytest.raises(SystemExit):
        main(["finetune", str(tmp_path / "model"), str(task), "--seeds", "10", "--seed-list", "7"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["finetune", str(tmp_path / "model"), str(task), "--heldout-fraction", "0.3"]) == 2
    assert "--heldout-fraction 0.3: only with --lrs" in capsys.readouterr().err


def long_tasks(tmp_path):
    """A sentence task and a CoNLL task whose sentences are longer than 32 tokens."""
    words = PAIR_WORDS * 2
    rows = "".join(f"{' '.join(words[i:] + words[:i])}\t{i % 2}\n" for i in range(4))
    tsv = write_task(tmp_path / "tsv", "sentence\tlabel\n" + rows)
    conll = tmp_path / "conll"
    conll.mkdir()
    for split in ("train", "dev"):
        (conll / f"{split}.txt").write_text(
            "".join(f"{w} NN {'B' if i % 2 else 'I'}-NP\n" for i, w in enumerate(words))
        )
    return tsv, conll


def test_max_seq_len_beyond_the_models_positions_is_refused(tmp_path):
    model = tiny_bert(tmp_path / "m32", PAIR_WORDS, positions=32)
    for task in long_tasks(tmp_path):
        with pytest.raises(UserError, match=r"--max-seq-len 48 is longer than .*m32 takes \(32 positions\)"):
            finetune(model, task, [1], mode="probe", epochs=1, max_seq_len=48)
        assert finetune(model, task, [1], mode="probe", epochs=1, max_seq_len=32)["max_seq_len"] == 32
        # without a length, the model's positions (fewer than the usual 128): not refused
        assert finetune(model, task, [1], mode="probe", epochs=1)["max_seq_len"] == 32


def test_a_model_without_its_tokenizer_or_with_a_larger_one_is_refused(tmp_path):
    """Without a tokenizer beside the model, transformers made up a 5-token one: every word read [UNK], and fine-tuning
    scored nothing, rc 0. A tokenizer of more tokens than the model's vocabulary failed mid-run with an IndexError."""
    import json

    from pretrain.evaluation.evaluate import evaluate_mlm

    model = tiny_bert(tmp_path / "m", PAIR_WORDS)
    tokenizer = {name: (model / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}
    for name in tokenizer:
        (model / name).unlink()
    tasks = long_tasks(tmp_path)
    for task in tasks:
        with pytest.raises(UserError, match=r"m: no tokenizer \(tokenizer.json, vocab.txt"):
            finetune(model, task, [1], mode="probe", epochs=1, max_seq_len=32)
    for name, data in tokenizer.items():
        (model / name).write_bytes(data)
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": vocab - 3}))
    for task in tasks:
        with pytest.raises(UserError, match=rf"its tokenizer has {vocab} tokens, more than the model's vocabulary"):
            finetune(model, task, [1], mode="probe", epochs=1, max_seq_len=32)
    with pytest.raises(UserError, match=rf"its tokenizer has {vocab} tokens, more than the model's vocabulary"):
        (tmp_path / "held-out.txt").write_text("the words of a held-out text\n")
        evaluate_mlm(model, corpus=[str(tmp_path / "held-out.txt")])


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_a_classifier_of_another_label_count_gets_a_new_head(tmp_path, capsys, head):
    """A *ForSequenceClassification (or token) model fine-tuned on a task of 5 labels, started on one of 2."""
    model = tiny_bert(tmp_path / "tuned", PAIR_WORDS, head=head, num_labels=5)
    tsv, conll = long_tasks(tmp_path)
    result = finetune(model, tsv if head == "sequence" else conll, [1, 2], mode="full", epochs=1, max_seq_len=32)
    assert result["num_labels"] == 2 and len(result["per_seed"]) == 2
    err = capsys.readouterr().err
    assert "its head was trained for 5 labels, this task has 2: re-initialised for 2 labels" in err
    assert err.count("re-initialised") == 1  # once, not per seed


def test_only_the_head_is_re_initialised(tmp_path):
    """An encoder weight that does not fit config.json is a broken directory, not a head to draw afresh."""
    import json

    from pretrain.evaluation.finetune import load_model

    model = tiny_bert(tmp_path / "tuned", PAIR_WORDS, head="sequence", num_labels=5)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(UserError, match=r"tuned: weights \['bert\.encoder\..*'\] do not have the shapes its config"):
        load_model(model, 2, "classification")


def test_json_goes_into_new_directories_and_a_directory_is_refused_first(tmp_path, capsys):
    """--json into a directory that does not exist yet: created, the result kept (it crashed after the work); a
    --json naming a directory is refused before any work (here: before the missing model is even looked at)."""
    import json

    from pretrain.cli import main

    tsv, _ = long_tasks(tmp_path)
    model = tiny_bert(tmp_path / "m", PAIR_WORDS, positions=32)
    out = tmp_path / "results" / "probe" / "r.json"
    argv = ["finetune", str(model), str(tsv), "--mode", "probe", "--epochs", "1", "--seeds", "1", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["mode"] == "probe"
    assert main(["finetune", str(tmp_path / "no-model"), str(tsv), "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path} is a directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("mine")
    assert main(["eval", str(tmp_path / "no-run"), "--shards", "s", "--json", str(tmp_path / "file" / "r.json")]) == 2
    assert f"{tmp_path / 'file'} is a file, not a directory" in capsys.readouterr().err


def test_a_missing_task_directory_says_where_to_get_it(tmp_path):
    """As `pretrain ablate` does for a task a preset names (it said only 'task file not found')."""
    with pytest.raises(UserError, match=r"rte: task directory not found .*'rte' is nltk_data's `rte` corpus"):
        load_task(tmp_path / "data" / "tasks" / "rte")
    with pytest.raises(UserError, match=r"mine: task directory not found \(a path relative to the directory you"):
        load_task(tmp_path / "mine")


def test_fine_tuning_decays_matrices_not_biases_or_layer_norms():
    """As pretraining (`optim.param_groups`), BERT's fine-tuning code and transformers' Trainer: AdamW's weight decay
    leaves biases and LayerNorm weights alone. A loss with no gradient leaves only the decay to move anything."""
    import torch

    from pretrain.evaluation.fit import fit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    fit(model, lambda idx: sum(p.sum() for p in model.parameters()) * 0, 8, 0, 2, 0.1, 4, 0.0, "decay")
    moved = sorted(name for name, p in model.named_parameters() if not torch.equal(p, before[name]))
    assert moved == ["0.weight"]  # was every parameter: the bias and the LayerNorm's weight and bias shrank too


def test_the_sweeps_seeds_are_options_of_pretrain_finetune(monkeypatch):
    """--heldout-seed and --sweep-seeds reach the fine-tuning (an ablation's eval: set them; the CLI could not)."""
    import pretrain.evaluation.finetune as finetune_module
    from pretrain.cli import main

    got = {}

    def finetune(model_dir, task_dir, seeds, *options):
        got.update(seeds=seeds, heldout_seed=options[-2], sweep_seeds=options[-1])
        return {}

    monkeypatch.setattr(finetune_module, "finetune", finetune)
    monkeypatch.setattr(finetune_module, "format_finetune", lambda result: "")
    argv = ["finetune", "model", "task", "--lrs", "1e-4", "3e-4", "--heldout-seed", "7", "--sweep-seeds", "2"]
    assert main(argv) == 0
    assert got == {"seeds": [1, 2, 3], "heldout_seed": 7, "sweep_seeds": 2}


def test_label_errors_name_the_line(tmp_path):
    """A regression label that is not a number named 'example 3' (on line 5: a blank line and the header before
    it); a dev label unseen in train named no line at all."""
    reg = write_task(tmp_path / "reg", "sentence\tlabel\na\t0.5\n\nb\t1.5\nc\tn/a\n", "sentence\tlabel\na\t0.5\n")
    with pytest.raises(UserError, match=r"reg/train\.tsv:5: label 'n/a' is not a number"):
        load_task(reg, "regression")
    unseen = write_task(tmp_path / "u", "sentence\tlabel\na\tyes\nb\tno\n", "sentence\tlabel\na\tyes\nb\tmaybe\n")
    with pytest.raises(UserError, match=r"u/dev\.tsv:3: label\(s\) \['maybe'\] never appear in train\.tsv"):
        load_task(unseen)


def test_a_max_seq_len_that_leaves_no_text_is_refused(tmp_path, capsys):
    """--max-seq-len 3 kept neither sentence of a pair ([CLS] [SEP] [SEP]), 4 only the second, 2 no text at all:
    scores at chance, with no word."""
    from pretrain.cli import main

    model = tiny_bert(tmp_path / "m", PAIR_WORDS)
    pair = write_task(tmp_path / "pair", "sentence1\tsentence2\tlabel\na b\tc d\t0\nc d\ta b\t1\n")
    single = write_task(tmp_path / "single", "sentence\tlabel\na b\t0\nc d\t1\n")
    for task, length, said in (
        (pair, 4, "--max-seq-len 4 leaves a sentence pair of pair no room for both sentences"),
        (single, 2, "max_seq_len: 2 leaves no room for text ([CLS] and [SEP] take 2); give at least 3"),
    ):
        assert main(["finetune", str(model), str(task), "--max-seq-len", str(length), "--seeds", "1"]) == 2
        assert said in capsys.readouterr().err


def test_each_seed_is_its_own_run_and_a_seed_again_the_same():
    """Seeds are what the spread over seeds (and an ablation's medians) rests on: a probe seeded by anything but its
    seed made every seed the same run, and the tests counted 5 results of one."""
    import torch

    from pretrain.evaluation.finetune import Task, train_probe

    gen = torch.Generator().manual_seed(0)
    train_x, dev_x = torch.randn(40, 8, generator=gen), torch.randn(10, 8, generator=gen)
    labels = (train_x[:, 0] + 0.1 * torch.randn(40, generator=gen)).tolist()
    task = Task("t", "regression", False, [], ([""] * 40, None, labels), ([""] * 10, None, [0.0] * 10))
    runs = [train_probe(task, train_x, dev_x, seed, epochs=2, batch_size=8)[1] for seed in (1, 2, 1)]
    assert runs[0] == runs[2] and runs[0] != runs[1]


def test_eval_of_an_export_never_writes_into_a_users_eval_folder(tmp_path):
    """The held-out shards of an exported model are cached in <its parent>/eval: any folder of the user's, written into
    (and a file of that name was a NotADirectoryError traceback)."""
    from pretrain.evaluation.evaluate import evaluate_mlm

    model = tiny_bert(tmp_path / "models" / "m", PAIR_WORDS)
    held = tmp_path / "held-out.txt"
    held.write_text(" ".join(PAIR_WORDS * 8) + "\n")
    users = tmp_path / "models" / "eval"
    users.mkdir()
    (users / "results.txt").write_text("mine")
    with pytest.raises(UserError, match=r"models/eval is where held-out shards .* left untouched; give --shards"):
        evaluate_mlm(model, corpus=[str(held)], max_samples=1)
    assert [p.name for p in users.iterdir()] == ["results.txt"]
    from data_pipeline.shards import build_shards

    given = tmp_path / "given-shards"
    build_shards([str(held)], model, given, num_workers=0, show_progress=False)
    assert evaluate_mlm(model, shards=str(given), max_samples=1)["shards"] == str(given)  # no cache: not refused
    assert [p.name for p in users.iterdir()] == ["results.txt"]
    users.rename(tmp_path / "mine")
    users.write_text("a file")
    with pytest.raises(UserError, match=r"models/eval is where held-out shards"):
        evaluate_mlm(model, corpus=[str(held)], max_samples=1)
    users.unlink()
    first = evaluate_mlm(model, corpus=[str(held)], max_samples=1)  # absent: made, and read again the next time
    assert Path(first["shards"]).parent == users and evaluate_mlm(model, corpus=[str(held)], max_samples=1) == first


def test_a_torn_model_directory_is_named_not_a_traceback(tmp_path):
    """A truncated model.safetensors or a torn config.json was a SafetensorError or JSONDecodeError traceback."""
    from pretrain.evaluation.evaluate import evaluate_mlm

    model = tiny_bert(tmp_path / "m", PAIR_WORDS)
    tsv, _ = long_tasks(tmp_path)
    (tmp_path / "held-out.txt").write_text(" ".join(PAIR_WORDS) + "\n")
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[:5000])
    for run in (
        lambda: finetune(model, tsv, [1], mode="probe", epochs=1, max_seq_len=32),
        lambda: evaluate_mlm(model, corpus=[str(tmp_path / "held-out.txt")]),
    ):
        with pytest.raises(UserError, match=r"model.safetensors: truncated or not a safetensors file"):
            run()
    (model / "model.safetensors").write_bytes(weights)
    config = (model / "config.json").read_text()
    (model / "config.json").write_text('{"model_type": "bert", "hidden_size": 32')
    with pytest.raises(UserError, match=r"config.json: not valid JSON"):
        evaluate_mlm(model, corpus=[str(tmp_path / "held-out.txt")])
    # a pytorch_model.bin (torch.save's zip) cut short: a PytorchStreamReader traceback
    (model / "config.json").write_text(config)
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    whole = (model / "pytorch_model.bin").read_bytes()
    (model / "pytorch_model.bin").write_bytes(whole[: len(whole) // 2])  # beside the safetensors: never read
    assert evaluate_mlm(model, corpus=[str(tmp_path / "held-out.txt")], max_samples=1)["samples"] == 1
    (model / "pytorch_model.bin").write_bytes(whole)
    (model / "model.safetensors").unlink()
    assert evaluate_mlm(model, corpus=[str(tmp_path / "held-out.txt")], max_samples=1)["samples"] == 1  # whole: read
    torn = (model / "pytorch_model.bin").read_bytes()
    (model / "pytorch_model.bin").write_bytes(torn[: len(torn) // 2])
    with pytest.raises(UserError, match=r"pytorch_model.bin: truncated or not a torch weights file"):
        evaluate_mlm(model, corpus=[str(tmp_path / "held-out.txt")])


def test_eval_holds_its_shards_while_it_scores(tmp_path, monkeypatch):
    """`pretrain eval` opened the shards and scored them while another process could rebuild them in place (`pretrain
    shards --out` into them): the reader, which opens the files by name as it goes, read new tokens at the old
    offsets and scored a mix of two corpora. The shards are held until scored: such a build is refused meanwhile."""
    from data_pipeline.shards import build_shards
    from pretrain.core.errors import DataError
    from pretrain.evaluation import evaluate

    model = tiny_bert(tmp_path / "m", PAIR_WORDS)
    held, other = tmp_path / "held-out.txt", tmp_path / "other.txt"
    held.write_text(" ".join(PAIR_WORDS * 8) + "\n")
    other.write_text(" ".join(reversed(PAIR_WORDS * 8)) + "\n")
    given = tmp_path / "given-shards"
    build_shards([str(held)], model, given, num_workers=0, show_progress=False)
    score, refused = evaluate._score_masked, []

    def rebuilt_meanwhile(*args):
        with pytest.raises(DataError, match="holds shards another process is reading now"):
            build_shards([str(other)], model, given, num_workers=0, show_progress=False)
        refused.append(True)
        return score(*args)

    monkeypatch.setattr(evaluate, "_score_masked", rebuilt_meanwhile)
    evaluate.evaluate_mlm(model, shards=str(given), max_samples=1)
    assert refused
    build_shards([str(other)], model, given, num_workers=0, show_progress=False)  # scored: the build goes ahead
