"""The launch scripts on one machine: real CPU runs, and stand-ins on PATH (`pdsh`, `ssh`, `scontrol`, `srun`,
`torchrun`) that record what a launcher gives them. tests/test_multinode.py runs the launchers across two hosts."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import small_corpus

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
VENV_BIN = Path(sys.executable).parent
# What a launcher sets or reads: none of it may leak in from the environment the tests run in (a CI job on SLURM)
LAUNCH_VARS = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|NNODES|NODE_RANK|"
    r"GLOO_SOCKET_IFNAME|NCCL_SOCKET_IFNAME|CROSS_RANK|CROSS_SIZE|DS_ENV_FILE|SLURM_.*|SLURMD_.*|SRUN_.*|"
    r"TORCHELASTIC_.*)"
)
LAUNCH_TIMEOUT = 480  # one launch: about a minute on an idle machine, much longer on a busy 2-core one


def env_for(*front: Path, **variables) -> dict[str, str]:
    """The environment of a launch: this one's python, deepspeed and torchrun first on PATH (after `front`, where
    stand-ins go), CPU ranks of one thread each."""
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARS.fullmatch(k)}
    env.update(
        DS_ACCELERATOR="cpu",
        WANDB_MODE="disabled",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PATH=os.pathsep.join([*map(str, front), str(VENV_BIN), env.get("PATH", "")]),
    )
    env.update({k: str(v) for k, v in variables.items()})
    return env


def stand_in(directory: Path, name: str, script: str) -> None:
    path = directory / name
    path.write_text(script)
    path.chmod(0o755)


# A stand-in that records its name and arguments, one a line, in $STAND_IN_LOG
RECORD = """#!/bin/sh
printf '%s\\n' "$0" "$@" >> "$STAND_IN_LOG"
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A corpus, and a tokenizer and shards built from it, shared by the runs."""
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("launchers")
    corpus = small_corpus(d, slice(0, 12))
    train_tokenizer([corpus], d / "tok", vocab_size=512, show_progress=False)
    build_shards([corpus], d / "tok", d / "shards", num_workers=0, show_progress=False)
    return d


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# Bash


def test_launchers_expand_arrays_that_may_be_empty_safely():
    """Under set -u, bash before 4.4 (macOS's 3.2, CentOS 7's 4.2) calls "${a[@]}" of an empty array unbound:
    multi_node.sh failed so without NODE_RANK. Each array expansion takes the ${a[@]+"${a[@]}"} form."""
    for script in [*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch")]:
        text = re.sub(r'\$\{(\w+)\[@\]\+"\$\{\1\[@\]\}"\}', "", script.read_text())
        assert not re.search(r"\$\{\w+\[@\]\}", text), f"{script.name}: an unguarded array expansion"


# ----------------------------------------------------------------------------------------------
# torchrun.sh


def test_torchrun_across_nodes_needs_master_addr(tmp_path):
    """NNODES > 1: `pretrain train`, on data prepared once and shared; without MASTER_ADDR a one-line error and no
    torchrun, where 127.0.0.1 left every node but the first waiting for a rendezvous on itself, without a word."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "torchrun", RECORD)
    log = tmp_path / "torchrun.args"
    env = env_for(bin_dir, STAND_IN_LOG=log, NNODES=2, NODE_RANK=1)
    proc = subprocess.run([LAUNCH / "torchrun.sh", "1", "tiny"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "MASTER_ADDR" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not log.exists(), "torchrun ran"

    env["MASTER_ADDR"] = "10.0.0.1"
    proc = subprocess.run([LAUNCH / "torchrun.sh", "1", "tiny"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    args = log.read_text().splitlines()
    assert args[args.index("--master_addr") + 1] == "10.0.0.1"
    assert args[-3:] == ["pretrain.cli", "train", "tiny"], args


# ----------------------------------------------------------------------------------------------
# slurm.sbatch under stand-in scontrol and srun

FAKE_SRUN = """#!/bin/sh
{ printf 'MASTER_ADDR=%s\\nMASTER_PORT=%s\\nSRUN_CPUS_PER_TASK=%s\\n' "$MASTER_ADDR" "$MASTER_PORT" \\
    "${SRUN_CPUS_PER_TASK-unset}"; printf '%s\\n' "$@"; } > "$STAND_IN_LOG"
"""
SCONTROL = "#!/bin/sh\nprintf 'node1\\nnode2\\n'\n"


def _sbatch(tmp_path: Path, scontrol: str, **variables) -> tuple[subprocess.CompletedProcess, Path]:
    """launch/slurm.sbatch as a batch job of a 2-node allocation runs it; the log holds what srun got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in(bin_dir, "scontrol", scontrol)
    stand_in(bin_dir, "srun", FAKE_SRUN)
    log = tmp_path / "srun.log"
    log.unlink(missing_ok=True)
    env = env_for(bin_dir, STAND_IN_LOG=log, SLURM_JOB_NODELIST="node[1-2]", **variables)
    proc = subprocess.run([LAUNCH / "slurm.sbatch", "tiny"], env=env, capture_output=True, text=True, timeout=60)
    return proc, log


def _srun_saw(log: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in log.read_text().splitlines()[:3])


def test_slurm_master_addr_defaults_to_the_first_node_and_a_users_is_kept(tmp_path):
    proc, log = _sbatch(tmp_path, SCONTROL)
    assert proc.returncode == 0, proc.stderr
    assert _srun_saw(log)["MASTER_ADDR"] == "node1"
    assert log.read_text().splitlines()[3:] == ["--kill-on-bad-exit=1", "python", "-m", "pretrain.cli", "train", "tiny"]

    proc, log = _sbatch(tmp_path, SCONTROL, MASTER_ADDR="node1-ib", MASTER_PORT=29600)
    assert proc.returncode == 0, proc.stderr
    assert _srun_saw(log)["MASTER_ADDR"] == "node1-ib"  # it was replaced by the first node's hostname
    assert _srun_saw(log)["MASTER_PORT"] == "29600"


def test_slurm_a_failing_scontrol_stops_the_job_before_srun(tmp_path):
    """`export MASTER_ADDR=$(scontrol ...)` hid scontrol's failure from set -e: srun started every task with an
    empty MASTER_ADDR."""
    proc, log = _sbatch(tmp_path, "#!/bin/sh\necho 'scontrol: error: no such job' >&2\nexit 1\n")
    assert proc.returncode != 0
    assert not log.exists(), "srun ran"
    assert "MASTER_ADDR" in proc.stderr, proc.stderr


def test_slurm_srun_gets_the_jobs_cpus_per_task(tmp_path):
    """srun does not inherit --cpus-per-task from the batch job on Slurm >= 22.05 unless SRUN_CPUS_PER_TASK says it."""
    proc, log = _sbatch(tmp_path, SCONTROL, SLURM_CPUS_PER_TASK=8)
    assert proc.returncode == 0, proc.stderr
    assert _srun_saw(log)["SRUN_CPUS_PER_TASK"] == "8"
    proc, log = _sbatch(tmp_path, SCONTROL)
    assert _srun_saw(log)["SRUN_CPUS_PER_TASK"] == "unset"


# ----------------------------------------------------------------------------------------------
# What a launcher runs on one node


@pytest.mark.slow
def test_torchrun_on_one_node_runs_every_stage_as_single_node_does(data):
    """README's `launch/torchrun.sh 8 bert-base`: on one node, the tokenizer and shards are built (once, on rank 0),
    trained on and exported, as by launch/single_node.sh; it ran `pretrain train`, which found no tokenizer."""
    name = "torchrun-run"
    cmd = [
        LAUNCH / "torchrun.sh",
        2,
        "tiny",
        f"output_dir={data}",
        f"name={name}",
        f"data.corpus={data / 'speeches.jsonl'}",
        "data.vocab_size=512",
        "model.num_layers=1",
        "train.max_steps=2",
    ]
    proc = subprocess.run(
        list(map(str, cmd)),
        env=env_for(MASTER_PORT=_port()),
        cwd=data,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = data / name
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    assert (run_dir / "hf" / "config.json").is_file(), proc.stderr[-3000:]
