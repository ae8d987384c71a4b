"""The trainer's state (trainer_state.json) is read and written in one place, and loads from older checkpoints; the
stop reason keeps the strings summaries and logs always had; a run's derived values are decided once."""

import json
import os

import numpy as np
import pytest

from pretrain.core.config import TrainConfig
from pretrain.core.errors import UserError
from pretrain.core.tokens import SpecialTokens
from pretrain.train.distributed import BF16_AUTOCAST, run_precision
from pretrain.train.state import STATE_FILE, StopReason, TrainState
from pretrain.train.stopping import EXIT_NONFINITE, StopFlag, Stopping


def test_state_round_trips_with_the_historical_layout(tmp_path):
    state = TrainState(step=7, consumed_samples=56, tokens_seen=900, elapsed_s=1.5, world_size=2, fingerprint={"a": 1})
    state.phase, state.phase_start_samples = 1, 48  # recorded by runs with a schedule only
    state.save(tmp_path)
    data = json.loads((tmp_path / STATE_FILE).read_text())
    assert list(data) == [
        "step",
        "consumed_samples",
        "tokens_seen",
        "elapsed_s",
        "skipped_steps",
        "skipped_in_a_row",
        "world_size",
        "fingerprint",
        "phase",  # keys added later come after the historical ones
        "phase_start_samples",
    ]
    assert TrainState.load(tmp_path) == state


def test_an_old_checkpoints_state_still_loads(tmp_path):
    """Written before skip counts, world size and fingerprints were recorded, with a key we no longer know: the
    missing ones take their defaults (None where their absence means something), the unknown one is kept."""
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 40, "consumed_samples": 320, "note": "kept"}))
    state = TrainState.load(tmp_path)
    assert (state.step, state.consumed_samples, state.tokens_seen, state.skipped_steps) == (40, 320, 0, 0)
    assert state.world_size is None and state.fingerprint is None
    assert state.to_dict() == {
        "step": 40,
        "consumed_samples": 320,
        "tokens_seen": 0,
        "elapsed_s": 0.0,
        "skipped_steps": 0,
        "skipped_in_a_row": 0,
        "note": "kept",
    }


def test_a_state_that_is_not_one_is_a_message(tmp_path):
    (tmp_path / STATE_FILE).write_text("[1, 2]")
    with pytest.raises(UserError, match="does not hold a trainer state"):
        TrainState.load(tmp_path)
    (tmp_path / STATE_FILE).write_text("{")
    with pytest.raises(UserError, match="cannot read"):
        TrainState.load(tmp_path)


def test_stop_reasons_are_the_strings_they_were():
    assert [r.value for r in StopReason] == ["max_steps", "signal", "max_minutes", "exit_after_steps", "nonfinite"]
    assert StopReason.SIGNAL == "signal" and f"{StopReason.MAX_MINUTES}" == "max_minutes" == str(StopReason.MAX_MINUTES)
    assert json.dumps({"reason": StopReason.NONFINITE}) == '{"reason": "nonfinite"}'


def test_stopping_counts_skips_in_the_state():
    state = TrainState(step=10, skipped_steps=3, skipped_in_a_row=1)
    stopping = Stopping(TrainConfig(max_skipped_steps=3), state, StopFlag())
    assert stopping.count_skips([True, False, True]) == (2, False)
    assert (state.skipped_steps, state.skipped_in_a_row) == (5, 1)
    assert stopping.count_skips([True, True]) == (2, True)
    assert (state.skipped_steps, state.skipped_in_a_row) == (7, 3)
    assert (stopping.reason, stopping.exit_code) == (StopReason.NONFINITE, EXIT_NONFINITE)


def test_stopping_names_its_reason():
    flag = StopFlag()
    stopping = Stopping(TrainConfig(exit_after_steps=2), TrainState(step=5), flag)
    assert not any(stopping.requested(6)) and stopping.requested(7) == (False, False, True)
    stopping.stop(False, False)
    assert (stopping.reason, stopping.exit_code) == (StopReason.EXIT_AFTER_STEPS, 0)
    # the reasons are OR-ed over ranks first: another rank's clock is this rank's reason too (it was
    # exit_after_steps here, whose clock had not run out, and `pretrain run` then did not export)
    stopping.stop(False, True)
    assert (stopping.reason, stopping.exit_code) == (StopReason.MAX_MINUTES, 0)
    flag.signal = 15
    assert stopping.requested(6)[0]
    stopping.stop(True, False)
    assert stopping.reason == StopReason.SIGNAL and stopping.exit_code == 75


def test_the_run_is_resolved_once(tmp_path):
    from pretrain.core.config import build_config
    from pretrain.train.setup import resolve_run

    cfg = build_config({"train": {"micro_batch_size": 4, "grad_accum_steps": 3, "precision": "bf16"}})
    tokens = SpecialTokens(pad=1, unk=0, cls=2, sep=3, mask=4, vocab_size=50, replaceable=np.arange(5, 50))
    run = resolve_run(cfg, tokens, rank=1, world=2)
    assert (run.global_batch, run.precision, run.tokens.pad, run.is_main) == (24, BF16_AUTOCAST, 1, False)
    assert run.global_batch == cfg.train.global_batch(2)
    assert run_precision(cfg.train, legacy=True) == "bf16"
    assert run_precision(TrainConfig(precision="bf16", zero_stage=1)) == "bf16"
    assert run_precision(TrainConfig(precision="fp16")) == "fp16"


def test_pretrain_run_makes_the_process_group_with_the_configs_timeout(monkeypatch):
    """`pretrain run` makes the process group before the data stages, and the trainer's later init finds it made:
    its timeout must be train.collective_timeout_minutes (it was the default 30 minutes)."""
    import pretrain.train.distributed as distributed
    from pretrain.core.config import build_config
    from pretrain.pipeline import run_all

    class Made(Exception):
        pass

    def init(timeout_minutes=30.0):
        raise Made(timeout_minutes)

    monkeypatch.setattr(distributed, "init_distributed", init)
    with pytest.raises(Made) as made:
        run_all(build_config({"train": {"collective_timeout_minutes": 0.25}}))
    assert made.value.args == (0.25,)


class _Store:
    """The process group's key-value store, in memory (rank0_alone's channel from rank 0 to the others)."""

    def __init__(self, **values):
        self.values = {k: v.encode() for k, v in values.items()}

    def set(self, key, value):
        self.values[key] = value

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]

    def add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


def _world_of_two(monkeypatch, rank, store):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import pretrain.train.distributed as distributed

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(distributed, "_waits", 0)


def test_rank0_alone_tells_the_other_ranks_how_rank_0s_work_ended(monkeypatch):
    """Rank 0 writes done or failed under the call's key, also where its work raised; the others return on done and
    raise a UserError on failed (rank 0's own error says why)."""
    from pretrain.core.errors import UserError
    from pretrain.train.distributed import rank0_alone

    store = _Store()
    _world_of_two(monkeypatch, 0, store)
    assert rank0_alone(lambda: 7, "work") == 7

    def fails():
        raise UserError("the corpus is bad")

    with pytest.raises(UserError, match="the corpus is bad"):
        rank0_alone(fails, "work", linger_seconds=0)  # no other rank here to read the outcome
    assert store.values == {"pretrain/rank0_alone/1": b"done", "pretrain/rank0_alone/2": b"failed"}

    _world_of_two(monkeypatch, 1, store)
    assert rank0_alone(lambda: pytest.fail("only rank 0 works"), "build the shards", poll_seconds=0) is None
    with pytest.raises(UserError, match="rank 0 could not build the shards"):
        rank0_alone(lambda: None, "build the shards", poll_seconds=0)


RANK0_ALONE = """
import os, sys, time
import torch.distributed as dist
from pretrain.core.errors import UserError
from pretrain.train.distributed import rank0_alone

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)

def work():
    time.sleep(1.5)  # rank 1 is polling meanwhile
    raise UserError("the corpus is bad")

try:
    rank0_alone(work, "prepare the tokenizer and shards", poll_seconds=1.0)
except UserError as err:
    print(f"rank {rank}: {err}", flush=True)
    sys.exit(1)  # at once, as `pretrain run` does: rank 0's store goes with it
"""


def test_rank0_alone_failure_reaches_the_other_ranks_of_a_real_group(tmp_path):
    """Two gloo ranks, the store in rank 0's process (as under the DeepSpeed launcher): rank 0's work fails and it
    exits at once. Rank 1, between two polls, met the store gone (DistNetworkError: 'Connection was likely closed')
    rather than the outcome; rank 0 now waits until the others have read it."""
    import socket
    import subprocess
    import sys

    from helpers import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "rank0_alone.py"
    script.write_text(RANK0_ALONE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], out
    assert out[0][0].strip() == "rank 0: the corpus is bad", out[0]
    assert out[1][0].strip() == "rank 1: rank 0 could not prepare the tokenizer and shards (its message says why)", out[
        1
    ]
