"""Checkpoint loading is safe: an integrity manifest is checked first, and nothing but tensors, plain data and a
short allowlist of DeepSpeed records is ever unpickled (DeepSpeed's own loads included)."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.core.errors import UserError
from pretrain.train.checkpoint import verify_integrity, weights_only_loads, write_integrity


class Payload:
    """Unpickling this would run a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_arbitrary_objects_are_never_unpickled(tmp_path):
    evil = tmp_path / "mp_rank_00_model_states.pt"
    marker = tmp_path / "ran"
    torch.save({"module": {"w": torch.zeros(2)}, "extra": Payload(marker)}, evil)
    with pytest.raises(UserError, match=rf"{tmp_path}.*holds a Python object we do not load.*system"):
        with weights_only_loads(tmp_path):
            torch.load(evil, weights_only=False)  # as DeepSpeed asks: overridden inside the context
    assert not marker.exists()
    assert torch.load.__name__ == "load"  # restored afterwards
    with weights_only_loads(tmp_path):  # tensors and plain data load fine
        torch.save({"w": torch.ones(3), "step": 4, "names": ["a"]}, tmp_path / "ok.pt")
        assert torch.load(tmp_path / "ok.pt")["step"] == 4


def test_integrity_names_the_bad_file(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.json").write_text("{}")
    write_integrity(tmp_path)
    verify_integrity(tmp_path)
    (tmp_path / "a.pt").write_bytes(b"x" * 99 + b"y")
    with pytest.raises(UserError, match=rf"{tmp_path}/a.pt is corrupt"):
        verify_integrity(tmp_path)
    (tmp_path / "a.pt").write_bytes(b"x" * 50)
    with pytest.raises(UserError, match=rf"{tmp_path}/a.pt is truncated"):
        verify_integrity(tmp_path)
    (tmp_path / "sub" / "b.json").unlink()
    (tmp_path / "a.pt").write_bytes(b"x" * 100)
    with pytest.raises(UserError, match=r"sub/b.json is missing"):
        verify_integrity(tmp_path)


class FakeEngine:
    """Writes a model file where DeepSpeed would: save_checkpoint's other steps are all ours."""

    def save_checkpoint(self, root, tag, save_latest):
        (Path(root) / tag).mkdir(parents=True)
        torch.save({"w": torch.ones(2)}, Path(root) / tag / "mp_rank_00_model_states.pt")


def test_a_checkpoint_is_on_the_disk_before_latest_names_it(tmp_path, monkeypatch):
    """Every file of the checkpoint and its directory are fsynced before `latest` is written, and the pointer's
    directory after: a power cut can leave the previous checkpoint as latest, never a name for truncated files."""
    from pretrain.train.checkpoint import save_checkpoint
    from pretrain.train.state import TrainState

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), None)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b)))
    path = save_checkpoint(FakeEngine(), tmp_path, TrainState(step=3), "model: {}\n", None, keep=2)
    synced, latest_at = set(), None
    for i, (kind, name, to) in enumerate(events):
        if kind == "fsync":
            synced.add(name)
        elif to == str(tmp_path / "latest"):
            latest_at = i
            break
        elif name in synced:  # an atomic write: its temporary file synced, then renamed into place
            synced.add(to)
    assert latest_at is not None and real_fsync is not os.fsync
    files = {str(p) for p in path.rglob("*")} | {str(path)}
    assert files <= synced, files - synced
    assert ("fsync", str(tmp_path), None) in events[latest_at:]  # the pointer's rename, after it


def test_a_checkpoint_that_does_not_fit_names_its_keys(tmp_path):
    """torch's message names the module on its first line and the keys after it: the error keeps the keys."""
    from pretrain.train.checkpoint import load_checkpoint

    class Refusing:
        def load_checkpoint(self, *args, **kwargs):
            torch.nn.Linear(2, 2).load_state_dict({"weight": torch.zeros(2, 2)})  # no bias: torch's own error

    ckpt = tmp_path / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    write_integrity(ckpt)
    with pytest.raises(UserError, match=r"does not fit this model: .*Missing key\(s\) in state_dict: \"bias\""):
        load_checkpoint(Refusing(), ckpt)


def test_a_rank_without_a_saved_rng_state_does_not_replay_step_0(tmp_path):
    """Resumed on more ranks than wrote the checkpoint, a new rank has no rng file: its stream moves on by the step
    (it restarted from the run's seed, replaying the dropout masks of step 0)."""
    from pretrain.train.checkpoint import load_checkpoint

    class Loading:
        def load_checkpoint(self, root, tag, **kwargs):
            return str(Path(root) / tag), {}

    def resumed_at(step: int) -> int:
        ckpt = tmp_path / f"s{step}" / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(f'{{"step": {step}}}')
        write_integrity(ckpt)
        torch.manual_seed(1234 * 1000 + 1)  # the trainer's seed for rank 1
        assert load_checkpoint(Loading(), ckpt).step == step
        return torch.initial_seed()

    assert len({resumed_at(2), resumed_at(3)}) == 2 and 1234 * 1000 + 1 not in {resumed_at(4)}


def test_checkpoints_past_step_99999999_are_found_and_rotated_in_step_order(tmp_path):
    """At step 100,000,000 a checkpoint is step_100000000 (nine digits). Tags were matched as exactly eight digits
    and ordered by name: `latest` naming it read as unreadable, so the next save (and a resume) stopped with 'latest
    is empty or unreadable', or with no older checkpoint left a resume started afresh; rotation never deleted it."""
    import shutil

    from pretrain.train.checkpoint import all_checkpoints, latest_checkpoint, save_checkpoint
    from pretrain.train.state import TrainState

    for step in (99_999_998, 99_999_999, 100_000_000, 100_000_001):
        save_checkpoint(FakeEngine(), tmp_path, TrainState(step=step), "model: {}\n", None, keep=2)
    assert [p.name for p in all_checkpoints(tmp_path)] == ["step_100000000", "step_100000001"]
    assert latest_checkpoint(tmp_path).name == "step_100000001"
    shutil.rmtree(tmp_path / "step_100000001")  # moved away by the user: the newest complete one before it
    assert latest_checkpoint(tmp_path).name == "step_100000000"


def test_a_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path, capfd):
    """Checkpoints 2, 4, 6, then `latest` pointed back at 4 (a resume past a loss spike, say at a lower lr): the new
    timeline's step 6 deleted the complete step 6 of the first. Now it is set aside (each time under a new name),
    where rotation and resume do not look; only a half-written directory at that step is removed."""
    from pretrain.train.checkpoint import INTEGRITY, LATEST, all_checkpoints, latest_checkpoint, save_checkpoint
    from pretrain.train.state import TrainState

    for step in (2, 4, 6):
        save_checkpoint(FakeEngine(), tmp_path, TrainState(step=step), "lr: 1.0e-3\n", None, keep=2)
    first = (tmp_path / "step_00000006" / INTEGRITY).read_text()
    for n, aside in enumerate(("step_00000006.superseded", "step_00000006.superseded-2")):
        (tmp_path / LATEST).write_text("step_00000004")
        save_checkpoint(FakeEngine(), tmp_path, TrainState(step=6), f"lr: {n}e-4\n", None, keep=2)
        assert f"kept as {tmp_path / aside}" in capfd.readouterr().err
        assert (tmp_path / aside / "config.yaml").read_text() == ("lr: 1.0e-3\n" if n == 0 else "lr: 0e-4\n")
    assert (tmp_path / "step_00000006.superseded" / INTEGRITY).read_text() == first
    assert [p.name for p in all_checkpoints(tmp_path)] == ["step_00000004", "step_00000006"]
    assert latest_checkpoint(tmp_path).name == "step_00000006"
    (tmp_path / "step_00000008").mkdir()  # what a killed save leaves: no record
    (tmp_path / "step_00000008" / "partial.pt").write_bytes(b"x")
    save_checkpoint(FakeEngine(), tmp_path, TrainState(step=8), "lr: 1e-4\n", None, keep=2)
    assert not (tmp_path / "step_00000008" / "partial.pt").exists() and not capfd.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("*superseded*")) == [
        "step_00000006.superseded",
        "step_00000006.superseded-2",
    ]


@pytest.mark.parametrize("last", ["integrity.json", "latest"])
def test_a_checkpoint_whose_record_or_pointer_does_not_fit_is_removed(tmp_path, last):
    """The integrity record and `latest` are written after every rank's files, outside the save's failure handling: a
    full disk there was a bare 'no space left on device', and the checkpoint without a record stayed, holding its
    space until a later save at the same step. Now it goes, as a failed save's files do, and the line says so."""
    from pretrain.train.checkpoint import INTEGRITY, LATEST, latest_checkpoint, save_checkpoint
    from pretrain.train.state import TrainState

    save_checkpoint(FakeEngine(), tmp_path, TrainState(step=3), "model: {}\n", None, keep=5)
    full = tmp_path / (
        f"step_00000004/.{INTEGRITY}.tmp-{os.getpid()}" if last != LATEST else f".latest.tmp-{os.getpid()}"
    )

    class FullAtTheEnd(FakeEngine):  # the model file fits; what comes after it does not
        def save_checkpoint(self, root, tag, save_latest):
            super().save_checkpoint(root, tag, save_latest)
            full.symlink_to("/dev/full")

    with pytest.raises(UserError, match="no space left on device.*step_00000003 stays the latest checkpoint"):
        save_checkpoint(FullAtTheEnd(), tmp_path, TrainState(step=4), "model: {}\n", None, keep=5)
    assert (tmp_path / LATEST).read_text().strip() == "step_00000003" and latest_checkpoint(tmp_path).name.endswith("3")
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_00000003"]
    verify_integrity(tmp_path / "step_00000003")


def test_a_checkpoint_write_that_fails_otherwise_is_not_called_a_full_disk(tmp_path, monkeypatch):
    """Where the disk held less than a checkpoint's size free, any failed write was 'no space left on device' (the
    guess meant for torch.save's zip writer, which gives no errno): a `latest` that could not be written for another
    reason (an I/O error of a network file system, EIO) was reported as a full disk, and the EIO was lost."""
    import errno

    from pretrain.train import checkpoint
    from pretrain.train.checkpoint import LATEST, save_checkpoint
    from pretrain.train.state import TrainState

    save_checkpoint(FakeEngine(), tmp_path, TrainState(step=3), "model: {}\n", None, keep=5)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1))

    def failing(path, text, sync=True):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(checkpoint, "write_atomic", failing)
    with pytest.raises(OSError, match="Input/output error"):
        save_checkpoint(FakeEngine(), tmp_path, TrainState(step=4), "model: {}\n", None, keep=5)
    assert (tmp_path / LATEST).read_text().strip() == "step_00000003" and not (tmp_path / "step_00000004").exists()


def test_each_checkpoint_carries_the_tokenizer_the_run_started_with(tmp_path):
    """Checkpoints copied the tokenizer directory as it was at each save: edited or trained again meanwhile, the
    later checkpoints (and their export) carried another tokenizer than the run's shards and embeddings. The trainer
    reads it once at the start (`read_tokenizer_files`) and each checkpoint writes those bytes."""
    from data_pipeline.tokenizer import read_tokenizer_files
    from pretrain.train.checkpoint import save_checkpoint
    from pretrain.train.state import TrainState

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"the": "run\'s"}')
    (tok / "vocab.txt").write_text("[PAD]\n")
    started = read_tokenizer_files(tok)
    (tok / "tokenizer.json").write_text('{"a": "new one"}')
    path = save_checkpoint(FakeEngine(), tmp_path / "ckpt", TrainState(step=3), "model: {}\n", started, keep=2)
    assert (path / "tokenizer" / "tokenizer.json").read_text() == '{"the": "run\'s"}'
    assert (path / "tokenizer" / "vocab.txt").read_text() == "[PAD]\n"
