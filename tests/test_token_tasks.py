"""Token classification on CoNLL column files: the reader's errors, BIO checks, labels on the first sub-token,
conlleval's chunk F1 on a hand-scored example, unseen dev tags, `pretrain finetune` end to end on a tiny model, and
the fine-tuned model loaded back by AutoModelForTokenClassification with identical logits."""

import json
from pathlib import Path

import pytest
import torch
from helpers import CONLL_NOUNS as NOUNS
from helpers import CONLL_VERBS as VERBS
from helpers import make_docs, tiny_bert, write_conll, write_jsonl

from pretrain.core.errors import UserError
from pretrain.core.tokens import IGNORE_INDEX
from pretrain.evaluation import token_tasks as tt
from pretrain.evaluation.stats import chunk_f1_from_sums

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny BERT (random weights) with a WordPiece vocabulary of whole words and characters, as an export holds."""
    return tiny_bert(tmp_path_factory.mktemp("tiny_bert"), ["the", ".", "fast", *NOUNS, *VERBS])


# ----------------------------------------------------------------------------------------------
# Reading


@pytest.mark.parametrize(
    "line,message",
    [
        ("pound NN", r"train\.txt:4: 2 column\(s\), the file's first line has 3"),
        (" NN B-NP", r"train\.txt:4: empty token"),
        ("pound NN NP", r"train\.txt:4: tag 'NP' is not BIO"),
        ("pound NN E-NP", r"train\.txt:4: tag 'E-NP' is not BIO"),
        ("pound NN B-", r"train\.txt:4: tag 'B-' is not BIO"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    good = ["-DOCSTART- -X- O", "", "Confidence NN B-NP"]
    (tmp_path / "train.txt").write_text("\n".join([*good, line, "in IN B-PP"]) + "\n")
    with pytest.raises(UserError, match=message):
        tt.read_conll(tmp_path / "train.txt")


def test_reader_sentences_docstart_and_tabs(tmp_path):
    path = tmp_path / "dev.txt"
    path.write_text("-DOCSTART-\tO\n\nA\tB-NP\nb\tI-NP\n\n\n-DOCSTART-\tO\nc\tO\r\n")
    assert tt.read_conll(path) == ([["A", "b"], ["c"]], [["B-NP", "I-NP"], ["O"]])
    assert [tt.bio_problem(t) for t in ("O", "B-NP", "I-PP", "I-")] == [None, None, None, tt.bio_problem("X")]
    assert tt.bio_problem("B-N P") and tt.bio_problem("o")


def test_task_directory_recognised_and_unseen_dev_tags_reported(tmp_path, capsys):
    from pretrain.evaluation.finetune import load_task

    task = load_task(write_conll(tmp_path / "chunks"))
    assert task.kind == "token" and task.labels == ["O", "B-NP", "I-NP", "B-VP"] and task.unseen == ["B-ADVP"]
    assert len(task.train[0]) == 24 and task.dev[0][-1][-2:] == ["fast", "."] and task.dev[2][-1][-2] == "B-ADVP"
    err = capsys.readouterr().err
    assert "warning:" in err and "['B-ADVP']" in err and "scored as misses" in err
    with pytest.raises(UserError, match="--task-type regression does not apply"):
        load_task(tmp_path / "chunks", "regression")
    # the model can only predict train tags: the unseen chunk is a miss, whatever else it gets right
    gold = task.dev[2]
    best = [[t if t in task.labels else "O" for t in s] for s in gold]
    m = tt.conlleval(gold, best)["metrics"]
    assert m["precision"] == 1.0 and m["recall"] == pytest.approx(16 / 17) and m["chunk_f1"] < 1


# ----------------------------------------------------------------------------------------------
# conlleval


def test_chunks_follow_conlleval_start_and_end_rules():
    assert tt.chunks(["B-NP", "I-NP", "B-NP", "O"]) == [(0, 2, "NP"), (2, 3, "NP")]
    assert tt.chunks(["O", "I-VP", "I-VP"]) == [(1, 3, "VP")]  # I- after O starts a chunk
    assert tt.chunks(["B-NP", "I-VP", "I-NP"]) == [(0, 1, "NP"), (1, 2, "VP"), (2, 3, "NP")]  # after another type
    assert tt.chunks(["O", "O"]) == [] and tt.chunks(["I-PP"]) == [(0, 1, "PP")]


def test_conlleval_on_a_hand_scored_example():
    gold = [
        "B-NP I-NP B-VP B-NP I-NP I-NP O B-PP B-NP".split(),  # NP VP NP(3-5) PP NP: 5 chunks
        "O I-VP I-VP O O".split(),  # VP(1-2): 1 chunk, started by an I-
    ]
    pred = [
        # NP VP ok; NP(3-4)+NP(5) a wrong boundary: 2 wrong chunks; PP ok; I-NP after B-PP starts a (right) NP
        "B-NP I-NP B-VP B-NP I-NP B-NP O B-PP I-NP".split(),
        "O B-VP I-VP O O".split(),  # the same chunk, though a tag differs
    ]
    out = tt.conlleval(gold, pred)
    m = out["metrics"]
    # correct 5 of 7 predicted, 6 gold chunks; 11 of 14 tags right
    assert m["precision"] == pytest.approx(5 / 7) and m["recall"] == pytest.approx(5 / 6)
    assert m["chunk_f1"] == pytest.approx(2 * 5 / (7 + 6)) and m["token_accuracy"] == pytest.approx(11 / 14)
    assert out["per_type"]["NP"] == pytest.approx(
        {"precision": 2 / 4, "recall": 2 / 3, "f1": 4 / 7, "gold": 3, "predicted": 4}
    )
    assert out["per_type"]["VP"]["f1"] == 1.0 and out["per_type"]["PP"]["f1"] == 1.0
    assert out["per_sentence"] == [[4, 6], [1, 1]] and out["gold_chunks"] == [5, 1]
    # the paired statistics' view: F1 from summed sentence counts
    assert chunk_f1_from_sums(5, 7, 6) == pytest.approx(m["chunk_f1"]) and chunk_f1_from_sums(0, 0, 0) == 0


# ----------------------------------------------------------------------------------------------
# Sub-tokens


def test_labels_on_the_first_sub_token_and_truncated_words(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    sentences = [["the", "rivers", "runs"], ["stone"]]  # 'rivers' -> river ##s
    enc, first = tt.encode_words(tok, sentences, max_seq_len=16)
    ids = enc["input_ids"][0].tolist()
    assert tok.convert_ids_to_tokens(ids[:6]) == ["[CLS]", "the", "river", "##s", "runs", "[SEP]"]
    assert first.tolist() == [[1, 2, 4], [1, -1, -1]]
    labels = tt.align_labels(first, [[1, 2, 3], [4]], enc["input_ids"].shape[1])
    X = IGNORE_INDEX
    assert labels.tolist() == [[X, 1, 2, X, 3, X], [X, 4, X, X, X, X]]
    # max_seq_len 4 keeps [CLS] the river [SEP]: 'runs' has no token, predicted O, counted
    enc, first = tt.encode_words(tok, sentences, max_seq_len=4)
    assert first.tolist() == [[1, 2, -1], [1, -1, -1]] and tt._words_without_token(first, sentences) == 1
    preds = torch.tensor([[0, 1, 2, 2], [0, 1, 0, 0]])
    assert tt.word_tags(preds, first, sentences, ["O", "B-NP", "I-NP"]) == [["B-NP", "I-NP", "O"], ["B-NP"]]


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_a_word_is_labelled_past_a_bare_space_piece(kind, tmp_path):
    """Byte-level BPE and Unigram give a word they cannot join to its space ('Ġ' ',', '▁' 'd' 'o' 'g') a bare
    space piece first: the word's tag sat on that piece, which holds nothing of the word (a fifth of CoNLL's words)."""
    from data_pipeline.tokenizer import train_tokenizer

    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(30, seed=1))
    tok = train_tokenizer([str(corpus)], tmp_path / kind, kind=kind, vocab_size=320, show_progress=False)
    sentences = [["the", ",", "dog"]]
    enc, first = tt.encode_words(tok, sentences, 16)
    pieces = tok.convert_ids_to_tokens(enc["input_ids"][0])
    assert any(p in tt.SPACE_PIECES for p in pieces)  # the case is there
    words = tok(sentences, is_split_into_words=True).word_ids(0)
    for w, pos in enumerate(first[0].tolist()):
        assert pos >= 0 and pieces[pos] not in tt.SPACE_PIECES and words[pos] == w, (w, pieces)


# ----------------------------------------------------------------------------------------------
# Fine-tuning


def test_finetune_cli_full_and_probe(model_dir, tmp_path, capsys):
    from pretrain.cli import main

    task = write_conll(tmp_path / "chunks")
    out = tmp_path / "full.json"
    args = ["finetune", str(model_dir), str(task), "--mode", "full", "--seeds", "2", "--epochs", "1"]
    args += ["--max-seq-len", "32"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "token" and result["main_metric"] == "chunk_f1" and result["mode"] == "full"
    assert set(result["summary"]) == {"chunk_f1", "precision", "recall", "token_accuracy"}
    assert result["unseen_dev_tags"] == ["B-ADVP"] and result["dev_words_without_token"] == 0
    assert len(result["dev_predictions"]) == 2 and len(result["dev_predictions"][0]) == len(result["dev_labels"]) == 8
    assert result["dev_labels"] == [2] * 7 + [3] and all(len(c) == 2 for c in result["dev_predictions"][0])
    assert "chunk_f1" in capsys.readouterr().out
    # the probe; 7 tokens cut the final '.' of dev's longest sentence: predicted O, reported
    assert main([*args[:-1], "7", "--mode", "probe", "--epochs", "5", "--json", str(out)]) == 0
    probe = json.loads(out.read_text())
    assert probe["mode"] == "probe" and 0 <= probe["summary"]["chunk_f1"]["mean"] <= 1
    assert probe["dev_words_without_token"] == 1 and len(probe["per_seed"]) == 2
    assert "1 word(s) scored on lie beyond --max-seq-len 7" in capsys.readouterr().err


def test_fine_tuned_model_loads_with_identical_logits(model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    task = tt.load_token_task(write_conll(tmp_path / "chunks"))
    tokenizer, model = tt.fit_token_model(model_dir, task, seed=1, epochs=2, lr=1e-3, batch_size=8, max_seq_len=32)
    saved = tt.save_token_model(model, tokenizer, tmp_path / "tagger")
    loaded = AutoModelForTokenClassification.from_pretrained(str(saved)).eval()
    assert loaded.config.id2label == dict(enumerate(task.labels))
    enc, _ = tt.encode_words(AutoTokenizer.from_pretrained(str(saved)), task.dev[0], 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**enc).logits, model.cpu()(**enc).logits, rtol=0, atol=0)
    assert tt.predict_tags(loaded, tokenizer, task.dev[0], 32) == tt.predict_tags(model, tokenizer, task.dev[0], 32)


def test_ablation_downstream_mixes_a_conll_task_with_a_sequence_task(model_dir, tmp_path):
    import numpy as np

    from pretrain.evaluation.ablate import downstream
    from pretrain.evaluation.ablation_plan import load_ablation

    conll = write_conll(tmp_path / "chunks")
    tsv = tmp_path / "polarity"
    tsv.mkdir()
    for split in ("train", "dev"):
        rows = [f"the {n} {v} .\t{i % 2}" for i, (n, v) in enumerate(zip(NOUNS, VERBS * 3))]
        (tsv / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    cfg = str(Path(__file__).resolve().parent.parent / "configs" / "ablation-tiny.yaml")
    ab = load_ablation(cfg, [f"output_dir={tmp_path / 'abl'}", f"eval.tasks=[{conll}, {tsv}]", "eval.seeds=[1, 2]"])
    results = downstream(ab, model_dir)["probe"]
    assert results["chunks"]["main_metric"] == "chunk_f1" and results["polarity"]["main_metric"] == "accuracy"
    # what the report's cells stack: [seeds, sentences, (correct, predicted)] beside the gold chunk counts
    assert (
        np.array(results["chunks"]["dev_predictions"]).shape == (2, 8, 2) and len(results["chunks"]["dev_labels"]) == 8
    )


def test_reader_encoding_byte_order_mark_and_other_bytes(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("\ufeffConfidence NN B-NP\nin IN B-PP\n", encoding="utf-8")
    assert tt.read_conll(path) == ([["Confidence", "in"]], [["B-NP", "B-PP"]])  # not '\ufeffConfidence'
    path.write_bytes("Confidence NN B-NP\n\ncaf\xe9 NN B-NP\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"train\.txt:3: byte 0xe9 is not UTF-8"):
        tt.read_conll(path)


def test_reader_splits_aligned_columns_on_runs_of_spaces(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("A NN  B-NP\nbig    JJ  I-NP\ndog NN I-NP\n\nran VBD  B-VP\n")
    assert tt.read_conll(path) == ([["A", "big", "dog"], ["ran"]], [["B-NP", "I-NP", "I-NP"], ["B-VP"]])
    path.write_text("A NN B-NP\n  NN I-NP\n")  # a line that starts with white space has no token
    with pytest.raises(UserError, match=r"train\.txt:2: empty token"):
        tt.read_conll(path)
