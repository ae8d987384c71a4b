"""The launch scripts on one machine: real CPU runs, and stand-ins on PATH (`pdsh`, `ssh`, `scontrol`, `srun`,
`torchrun`) that record what a launcher gives them. tests/test_multinode.py runs the launchers across two hosts."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
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
STOP_TIMEOUT = 120  # from the signal to the launcher's exit
EXIT_PREEMPTED = 75


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


def train_args(data: Path, name: str) -> list[str]:
    """A tiny run on the prepared data that outlasts a test (a signal stops it)."""
    return [
        "tiny",
        f"output_dir={data}",
        f"name={name}",
        f"data.corpus={data / 'speeches.jsonl'}",  # `pretrain run` finds its shards built from it
        f"data.tokenizer={data / 'tok'}",
        f"data.shards={data / 'shards'}",
        "model.num_layers=1",
        "train.max_steps=1000000",
        "train.save_every=0",
        "train.log_every=1",
    ]


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
    """NNODES > 1: `pretrain train`, on data prepared once and shared; without MASTER_ADDR (or NODE_RANK) a one-line
    error and no torchrun, where 127.0.0.1 left every node but the first waiting for a rendezvous on itself, without
    a word (and NODE_RANK 0 on every node gave each the same ranks)."""
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
    del env["NODE_RANK"]  # it became 0 on every node, each taking the same ranks
    proc = subprocess.run([LAUNCH / "torchrun.sh", "1", "tiny"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs NODE_RANK on each node" in proc.stderr and not log.exists()
    env["NODE_RANK"] = "1"
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
    proc, log = _sbatch(tmp_path, SCONTROL, SLURM_JOB_ID=123456)
    assert proc.returncode == 0, proc.stderr
    assert _srun_saw(log)["MASTER_ADDR"] == "node1"
    assert _srun_saw(log)["MASTER_PORT"] == "23456"  # the job's own: two jobs sharing node 0 took 29500 both
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


@pytest.mark.parametrize(
    "slurm, joins",
    [
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, False),  # the batch script itself
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1"}, False),  # srun -n1
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1"}, True),
    ],
)
def test_only_a_task_of_an_srun_step_of_several_joins_slurms_world(monkeypatch, slurm, joins):
    """Slurm sets SLURM_PROCID and SLURM_NTASKS in the batch script and in a one-task step too: taken for rank 0 of
    4 there, `pretrain train` looked for MPI (no mpi4py: a traceback) or waited for 3 ranks that never came."""
    from pretrain.core.errors import UserError
    from pretrain.train import distributed

    for name in [*distributed.LAUNCHER_VARS, "SLURM_NTASKS"]:
        # set first, so that monkeypatch restores it: the code under test writes RANK and the rest into os.environ,
        # and a RANK left behind made a later in-process run join a world of 2 (DeepSpeed then looked for MPI)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    if joins:
        with pytest.raises(UserError, match="an srun step of 2 tasks needs MASTER_ADDR and MASTER_PORT"):
            distributed._ranks_from_srun()
        monkeypatch.setenv("MASTER_ADDR", "node1")
        monkeypatch.setenv("MASTER_PORT", "29600")
    distributed._ranks_from_srun()
    ranks = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    assert ranks == ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"} if joins else dict.fromkeys(ranks))
    # a child run of its own (an ablation's arm) inherits none of it
    assert not {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"} & set(distributed.single_process_env())
    if joins:  # srun --gpus-per-task=1: task 1 sees one GPU, its device 0, which DeepSpeed reads from LOCAL_RANK too
        assert distributed._local_device(visible=1) == 0 and os.environ["LOCAL_RANK"] == "0"
        monkeypatch.setenv("LOCAL_RANK", "1")
        assert distributed._local_device(visible=8) == 1 and os.environ["LOCAL_RANK"] == "1"  # --gpus-per-node


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
        env=env_for(),  # no MASTER_PORT: one node takes a port free there (launch/forward_signals.sh, free_port)
        cwd=data,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = data / name
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    assert (run_dir / "hf" / "config.json").is_file(), proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# A signal to a launcher (real 2-rank CPU runs)


def _marked(mark: str) -> list[int]:
    """The processes whose environment holds `mark`: those of one launch, wherever they were reparented."""
    needle = f"LAUNCH_TEST_MARK={mark}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:  # gone, or not ours to read
                pass
    return found


def stop_mid_run(cmd: list, env: dict, data: Path, run_dir: Path, sig: signal.Signals) -> tuple[int, str]:
    """Start `cmd` (a launcher), send `sig` to the launcher's process alone once its ranks train, and return its
    exit status and output. Fails if the launcher outlives STOP_TIMEOUT or leaves a process of its launch behind;
    every process of the launch is killed in the end."""
    mark = uuid.uuid4().hex
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            list(map(str, cmd)),
            env={**env, "LAUNCH_TEST_MARK": mark},
            cwd=data,
            stdout=out,
            stderr=subprocess.STDOUT,
            # a shell ignores SIGINT in what it starts in the background (pytest, say), and a script cannot trap a
            # signal ignored when it starts: the launcher gets it as a terminal would give it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while " parameters on " not in log.read_text(errors="replace"):  # the trainer's first line: its handler is set
            assert proc.poll() is None, f"ended before training:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "no training in time"
            time.sleep(0.2)
        proc.send_signal(sig)
        try:
            status = proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_TIMEOUT} s after {sig.name}:\n{log.read_text()[-4000:]}")
        deadline = time.monotonic() + 10
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _marked(mark)
        assert not left, f"{sig.name} left {len(left)} process(es) of the launch running:\n{log.read_text()[-3000:]}"
        return status, log.read_text(errors="replace")
    finally:
        proc.kill()
        proc.wait()
        for pid in _marked(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def assert_saved(run_dir: Path, said: str) -> None:
    assert "checkpoint saved" in said, said[-3000:]
    latest = run_dir / "checkpoints" / "latest"
    assert latest.is_file(), said[-3000:]
    assert (run_dir / "checkpoints" / latest.read_text().strip()).is_dir()


@pytest.mark.slow
def test_single_node_sigterm_reaches_the_ranks_which_save_and_exit_75(data):
    """DeepSpeed's runner forwards no signal on one node: under `exec` it died alone, and its ranks trained on as
    orphans with nothing saved."""
    run_dir = data / "single-term"
    cmd = [LAUNCH / "single_node.sh", 2, *train_args(data, run_dir.name)]
    status, said = stop_mid_run(cmd, env_for(), data, run_dir, signal.SIGTERM)  # its port: one free here
    assert status == EXIT_PREEMPTED, said[-3000:]
    assert_saved(run_dir, said)


@pytest.mark.slow
def test_multi_node_without_ssh_sigint_reaches_the_ranks_which_save_and_exit_75(data, tmp_path):
    """launch/multi_node.sh with NODE_RANK set (the DeepSpeed launcher without ssh), one host of one rank, ^C."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    run_dir = data / "multi-int"
    cmd = [LAUNCH / "multi_node.sh", hostfile, *train_args(data, run_dir.name)]
    status, said = stop_mid_run(cmd, env_for(NODE_RANK=0, MASTER_PORT=_port()), data, run_dir, signal.SIGINT)
    assert status == EXIT_PREEMPTED, said[-3000:]
    assert_saved(run_dir, said)


@pytest.mark.slow
def test_torchrun_sigterm_reaches_the_workers_which_save_and_exit_75(data):
    """torchrun, signalled itself, ended in a SignalException and would kill its workers 30 s into the checkpoint;
    now the workers get the signal and exit 75, and torchrun exits 1 as for any worker's non-zero status."""
    run_dir = data / "torchrun-term"
    cmd = [LAUNCH / "torchrun.sh", 2, *train_args(data, run_dir.name)]
    status, said = stop_mid_run(cmd, env_for(MASTER_PORT=_port()), data, run_dir, signal.SIGTERM)
    assert_saved(run_dir, said)
    assert "SignalException" not in said, said[-3000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", said)) == {str(EXIT_PREEMPTED)}, said[-3000:]
    assert status == 1, said[-3000:]


# ----------------------------------------------------------------------------------------------
# multi_node.sh over ssh: the environment the remote ranks get

# pdsh as DeepSpeed's runner calls it: `pdsh -S -f N -w HOSTS "export K=V; ... " "cd DIR;" python -u -m
# deepspeed.launcher.launch ...`; the stand-in records its arguments and ends as if every node had.
FAKE_PDSH = RECORD + "printf '%s\\n' ---- >> \"$STAND_IN_LOG\"\n"


@pytest.mark.slow
def test_multi_node_over_ssh_passes_the_environment_to_the_remote_ranks(data, tmp_path):
    """DeepSpeed's runner exports to the other nodes only PYTHON*, NCCL* (GPUs) and the like, and the lines of
    .deepspeed_env: GLOO_SOCKET_IFNAME and WANDB_MODE, which the script header and README tell users to set, never
    reached them. Secrets stay out of the command (DeepSpeed logs it); the user's own .deepspeed_env files are read
    and left as they were."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "pdsh", FAKE_PDSH)
    stand_in(bin_dir, "ssh", "#!/bin/sh\nexit 0\n")  # the runner's check that ssh reaches the first host
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\n\nNCCL_IB_DISABLE=1")  # a blank line, no final newline
    (work / ".deepspeed_env").write_text("FROM_CWD=2\n")
    before = {p: p.read_text() for p in (home / ".deepspeed_env", work / ".deepspeed_env")}
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    log = tmp_path / "pdsh.args"
    env = env_for(
        bin_dir,
        HOME=home,
        TMPDIR=tmp_path,
        STAND_IN_LOG=log,
        GLOO_SOCKET_IFNAME="eth7",
        NCCL_SOCKET_IFNAME="ib0",
        NCCL_IB_DISABLE="0",
        WANDB_MODE="offline",
        WANDB_API_KEY="secret-key",
        HF_HOME="/shared/hf home",
        WANDB_NOTES="costs $5",  # DeepSpeed would put it in double quotes, where the shell expands $5
    )
    # the nodes' shell reads the arguments again: each must reach the ranks as given ($HOME unexpanded, a quote)
    odd = ["wandb.project=it's-$HOME;{a,b}", "wandb.notes=two words", "wandb.group=a\tb"]
    proc = subprocess.run(
        [LAUNCH / "multi_node.sh", hostfile, *train_args(data, "ssh"), *odd],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    args = log.read_text().split("----\n")[0].splitlines()
    assert args[args.index("-w") + 1] == "node-a,node-b", args
    exports = dict(re.findall(r"export (\w+)=([^;]*);", next(a for a in args if a.startswith("export "))))
    assert exports["GLOO_SOCKET_IFNAME"] == "eth7"
    assert exports["NCCL_SOCKET_IFNAME"] == "ib0"
    assert exports["WANDB_MODE"] == "offline"
    assert exports["DS_ACCELERATOR"] == "cpu"
    assert exports["OMP_NUM_THREADS"] == "1"
    assert exports["HF_HOME"] == '"/shared/hf home"'
    assert exports["FROM_HOME"] == "1" and exports["FROM_CWD"] == "2"
    assert exports["NCCL_IB_DISABLE"] == "1"  # a name in the user's file wins, as in DeepSpeed
    assert "WANDB_API_KEY" not in exports and "secret-key" not in proc.stdout + proc.stderr
    assert "WANDB_NOTES" not in exports and "WANDB_NOTES not passed on" in proc.stderr, proc.stderr[-3000:]
    assert {p: p.read_text() for p in before} == before
    assert not list(tmp_path.glob("deepspeed_env.*")), "the script's env file was left behind"
    remote = " ".join(args[args.index("pretrain.cli") + 2 :])  # after `train`, as pdsh hands it to each node's shell
    read = subprocess.run(["sh", "-c", f"printf '%s\\0' {remote}"], capture_output=True, text=True, env={"HOME": "/x"})
    assert read.stdout.split("\0")[:-1] == [*train_args(data, "ssh"), *odd]
    # one with a space sits in DeepSpeed's double quotes, where $ would act: refused, before anything starts
    proc = subprocess.run(
        [LAUNCH / "multi_node.sh", hostfile, "tiny", "wandb.notes=costs $5"], env=env, cwd=work, capture_output=True
    )
    assert proc.returncode == 2 and b"an argument with a space cannot hold" in proc.stderr
    # one host: DeepSpeed's runner starts it without pdsh or a shell, so the arguments go as they are, unquoted
    stand_in(bin_dir, "deepspeed", RECORD)
    one = tmp_path / "one-host"
    one.write_text("node-a slots=1\n")
    log.unlink()
    proc = subprocess.run([LAUNCH / "multi_node.sh", one, "tiny", *odd], env=env, cwd=work, capture_output=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert log.read_text().splitlines()[-5:] == ["train", "tiny", *odd[:2], "wandb.group=a\tb"]
