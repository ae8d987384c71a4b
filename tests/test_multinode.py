"""Several nodes, proven on one machine: two hosts made as network namespaces joined by a veth pair (each its own
address, hostname and interface, one CPU rank each, the file system shared as on a cluster). Each launcher in
launch/ runs across them, and its losses equal a one-host 2-rank run of the same global batch at every step:
torchrun, the DeepSpeed launcher (no ssh, started on each host), and the SLURM script under stand-in `srun` and
`scontrol`. A host lost mid-run (stopped, its link cut, killed) makes the other exit within a bounded time (the
collective timeout) with a message that names the checkpoint to resume from, and the next launch resumes bitwise
from the last checkpoint.

Making namespaces needs root and iproute2's `ip` (CI runs as root); where they cannot be made the tests are
skipped with the reason."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import small_corpus

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

IFNAME = "eth0"  # the same interface name on both hosts, as on most clusters (one GLOO_SOCKET_IFNAME for all)
ADDRS = ("10.77.0.1", "10.77.0.2")
HOSTNAMES = ("node1", "node2")  # what each host's /etc/hosts resolves (ip netns exec mounts /etc/netns/NS/hosts)
PREFIX = "pretrain-mn"  # namespaces are PREFIX<pid>-<n>-h1/-h2: unique per test process, swept when it is gone
STEPS, SAVE_EVERY = 8, 2
LAUNCH_TIMEOUT = 480  # one launch: seconds on an idle machine, much longer on a busy 2-core one
SURVIVOR_BOUND = 120  # a host killed: the other must be gone within this many seconds
# fp32 without dropout: runs that see the same samples compute the same numbers
EXACT = ["train.precision=fp32", "model.hidden_dropout=0", "model.attention_dropout=0"]
# What a launcher sets or reads: none of it may leak in from the environment the tests run in (a CI job on SLURM)
LAUNCH_VARS = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|NNODES|NODE_RANK|"
    r"GLOO_SOCKET_IFNAME|NCCL_SOCKET_IFNAME|CROSS_RANK|CROSS_SIZE|SLURM_.*|SLURMD_.*|TORCHELASTIC_.*)"
)


# ----------------------------------------------------------------------------------------------
# Two hosts


class CannotMake(Exception):
    pass


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *map(str, args)], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise CannotMake(f"`ip {' '.join(map(str, args))}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


@dataclass
class Host:
    netns: str
    hostname: str
    addr: str

    def exec(self, *cmd) -> list[str]:
        """`cmd` run on this host: in its network namespace, with its /etc/hosts."""
        return ["ip", "netns", "exec", self.netns, *map(str, cmd)]

    def pids(self) -> list[int]:
        """Every process on this host (in its network namespace)."""
        proc = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in proc.stdout.split()]

    @property
    def etc(self) -> Path:
        return Path("/etc/netns") / self.netns


def _kill_all(host: Host) -> None:
    for _ in range(20):
        pids = host.pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _tear_down(host: Host) -> None:
    _kill_all(host)
    _ip("netns", "del", host.netns, check=False)  # its end of the veth pair goes with it
    shutil.rmtree(host.etc, ignore_errors=True)


def _sweep_stale() -> None:
    """Namespaces left by a test process that is gone (killed, aborted): a parallel run's are left alone."""
    listed = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({re.escape(PREFIX)}(\d+)-\S+)", listed, re.M):
        netns, pid = name
        if not Path(f"/proc/{pid}").exists():
            _tear_down(Host(netns, "", ""))


def _make(hosts: list[Host]) -> None:
    for host in hosts:
        _ip("netns", "add", host.netns)
    a, b = hosts
    _ip("link", "add", IFNAME, "netns", a.netns, "type", "veth", "peer", "name", IFNAME, "netns", b.netns)
    names = "".join(f"{h.addr} {h.hostname}\n" for h in hosts)
    system_hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else "127.0.0.1 localhost\n"
    for host in hosts:
        _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
        _ip("-n", host.netns, "link", "set", IFNAME, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        host.etc.mkdir(parents=True, exist_ok=True)
        (host.etc / "hosts").write_text(system_hosts + names)


def _check_reachable(hosts: list[Host]) -> None:
    """A TCP connection from host 2 to host 1 by hostname, as the ranks will make it."""
    a, b = hosts
    server = textwrap.dedent(f"""
        import socket, sys
        s = socket.create_server(("{a.addr}", 0))
        print(s.getsockname()[1], flush=True)
        s.settimeout(30)
        s.accept()
    """)
    listener = subprocess.Popen(a.exec(sys.executable, "-c", server), stdout=subprocess.PIPE, text=True)
    try:
        port = int(listener.stdout.readline())
        client = subprocess.run(
            b.exec(sys.executable, "-c", f"import socket; socket.create_connection(('{a.hostname}', {port}), 10)"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if client.returncode != 0:
            raise CannotMake(f"host 2 cannot reach {a.hostname}:{port} over the veth pair: {client.stderr[-500:]}")
        listener.wait(timeout=30)
    except (ValueError, subprocess.TimeoutExpired) as err:
        raise CannotMake(f"no listener on host 1: {err}") from err
    finally:
        listener.kill()
        listener.wait()


_made = itertools.count()


def _new_hosts() -> list[Host]:
    tag = f"{PREFIX}{os.getpid()}-{next(_made)}"
    return [Host(f"{tag}-h{i + 1}", HOSTNAMES[i], ADDRS[i]) for i in range(2)]


@pytest.fixture(scope="module", autouse=True)
def namespaces_possible():
    """Skip the module, before its one-host reference run, where two hosts cannot be made: no root, no `ip`, or
    the kernel or sandbox refuses (EPERM, no veth)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): the two-host tests make network namespaces with it")
    if os.geteuid() != 0:
        pytest.skip("the two-host tests make network namespaces (`ip netns add`), which needs root")
    _sweep_stale()
    trial = _new_hosts()
    try:
        _make(trial)
    except CannotMake as err:
        pytest.skip(f"network namespaces cannot be made here: {err}")
    finally:
        for host in trial:
            _tear_down(host)


@pytest.fixture
def hosts():
    """Two hosts: network namespaces joined by a veth pair, each with its address on `eth0`, `lo` up, and an
    /etc/hosts naming both; torn down (every process on them killed) after the test."""
    made = _new_hosts()
    try:
        _make(made)
        _check_reachable(made)
    except CannotMake as err:
        for host in made:
            _tear_down(host)
        pytest.skip(f"network namespaces cannot be made here: {err}")
    try:
        yield made
    finally:
        for host in made:
            _tear_down(host)


# ----------------------------------------------------------------------------------------------
# The data, the tools on PATH, and the one-host reference (once per module)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("multinode")
    corpus = small_corpus(d, slice(0, 12))
    train_tokenizer([corpus], d / "tok", vocab_size=512, show_progress=False)
    build_shards([corpus], d / "tok", d / "shards", num_workers=0, show_progress=False)
    return d


# Stand-ins for SLURM's `srun` and `scontrol`, first on PATH. srun starts SLURM_NTASKS_PER_NODE tasks on each node
# of the allocation, with the variables real srun sets per task, each in its node's network namespace
# (FAKE_SLURM_NETNS, one per node in SLURM_JOB_NODELIST order); --kill-on-bad-exit ends the step when a task fails.
FAKE_SLURM = r"""
import os, re, subprocess, sys, time
from pathlib import Path


def hostnames(nodelist):
    names = []
    for prefix, ranges, plain in re.findall(r"([^,\[]*)\[([^\]]*)\]|([^,]+)", nodelist):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{i:0{len(lo)}d}")
    return names


def scontrol(args):
    if args[:2] != ["show", "hostnames"]:
        sys.exit(f"stand-in scontrol: only `scontrol show hostnames [LIST]`, not {args}")
    print("\n".join(hostnames(args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"])))


def srun(args):
    kill_on_bad_exit = False
    while args and args[0].startswith("-"):
        option = args.pop(0)
        kill_on_bad_exit |= option in ("-K", "--kill-on-bad-exit") or option.startswith("--kill-on-bad-exit=1")
    nodes = hostnames(os.environ["SLURM_JOB_NODELIST"])
    netns = os.environ["FAKE_SLURM_NETNS"].split()
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", "1"))
    tasks = []
    for node, (name, ns) in enumerate(zip(nodes, netns)):
        for local in range(per_node):
            env = dict(os.environ)
            env.pop("FAKE_SLURM_NETNS")
            env.update(
                SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_PROCID=str(node * per_node + local),
                SLURM_LOCALID=str(local), SLURM_NODEID=str(node), SLURMD_NODENAME=name, SLURM_TOPOLOGY_ADDR=name,
                SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"], SLURM_STEP_NUM_NODES=str(len(nodes)),
                SLURM_STEP_NUM_TASKS=str(len(nodes) * per_node), SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{len(nodes)})",
            )
            tasks.append((name, node * per_node + local, subprocess.Popen(["ip", "netns", "exec", ns, *args], env=env)))
    status = 0
    while any(p.poll() is None for _, _, p in tasks):
        for name, rank, p in tasks:
            if p.poll() not in (None, 0) and not status:
                status = p.returncode
                print(f"srun: error: {name}: task {rank}: Exited with exit code {p.returncode}", file=sys.stderr)
                if kill_on_bad_exit:
                    for _, _, other in tasks:
                        if other.poll() is None:
                            other.kill()
        time.sleep(0.1)
    sys.exit(status or next((p.returncode for _, _, p in tasks if p.returncode), 0))


{"srun": srun, "scontrol": scontrol}[Path(sys.argv[0]).name](sys.argv[1:])
"""


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Path:
    """A directory for the front of PATH: `python`, `torchrun` and `deepspeed` of this environment (the launch
    scripts call them by name), and the stand-in `srun` and `scontrol`. Only these: the rest of PATH (ninja, which
    builds DeepSpeed's CPU op for every test) stays as the other tests have it."""
    d = tmp_path_factory.mktemp("bin")
    here = Path(sys.executable).parent
    for name, target in [
        ("python", sys.executable),
        ("torchrun", here / "torchrun" if (here / "torchrun").exists() else shutil.which("torchrun")),
        ("deepspeed", here / "deepspeed" if (here / "deepspeed").exists() else shutil.which("deepspeed")),
    ]:
        assert target, f"no {name} in this environment"
        (d / name).write_text(f'#!/bin/sh\nexec "{target}" "$@"\n')
    for name in ("srun", "scontrol"):
        (d / name).write_text(f"#!{sys.executable}\n{FAKE_SLURM}")
    for f in d.iterdir():
        f.chmod(0o755)
    return d


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(tools: Path, **variables) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARS.fullmatch(k)}
    env.update(
        DS_ACCELERATOR="cpu",
        WANDB_MODE="disabled",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",  # one thread per rank: tiny models, 2 shared cores
        PATH=f"{tools}{os.pathsep}{env.get('PATH', '')}",
        **{k: str(v) for k, v in variables.items()},
    )
    return env


def train_args(data: Path, name: str) -> list[str]:
    """The same run everywhere: tiny, one layer, a micro-batch of 8 per rank (global batch 16 on 2 ranks)."""
    return [
        "tiny",
        f"output_dir={data}",
        f"name={name}",
        f"data.tokenizer={data / 'tok'}",
        f"data.shards={data / 'shards'}",
        "model.num_layers=1",
        f"train.max_steps={STEPS}",
        f"train.save_every={SAVE_EVERY}",
        "train.log_every=1",
        "train.warmup_steps=1",
        "train.collective_timeout_minutes=1",  # bounds the survivor's wait when a host goes silent
        *EXACT,
    ]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


@pytest.fixture(scope="module")
def reference(data, tools):
    """The losses of a one-host run: 2 CPU ranks through the DeepSpeed launcher, the same global batch."""
    cmd = [tools / "deepspeed", "--num_gpus", "2", "--master_port", _port(), "--module", "pretrain.cli", "train"]
    proc = subprocess.run(
        [*map(str, cmd), *train_args(data, "one-host")],
        env=env_for(tools),
        cwd=data,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    steps = losses(data / "one-host")
    assert [s for s, _ in steps] == list(range(1, STEPS + 1))
    return steps


# ----------------------------------------------------------------------------------------------
# Launching on the hosts


@dataclass
class Launch:
    host: Host
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start(host: Host, cmd: list, env: dict, data: Path, log: str) -> Launch:
    path = data / log
    with open(path, "w") as out:  # the child holds its own copy
        proc = subprocess.Popen(
            host.exec(*cmd), env=env, cwd=data, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Launch(host, proc, path)


def finish(launches: list[Launch], timeout: float = LAUNCH_TIMEOUT) -> None:
    """Every launch ends with status 0 within `timeout` (all killed otherwise), or the test fails with the logs."""
    deadline = time.monotonic() + timeout
    try:
        for launch in launches:
            launch.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    for launch in launches:
        if launch.proc.poll() is None:
            launch.proc.kill()
            launch.proc.wait()
    failed = [launch for launch in launches if launch.proc.returncode != 0]
    assert not failed, "\n\n".join(
        f"{launch.host.hostname}: status {launch.proc.returncode}\n{launch.output()[-4000:]}" for launch in failed
    )


def assert_same_steps(run_dir: Path, reference, launches: list[Launch]) -> None:
    first = launches[0].output()
    assert "on 2 processes" in first, first[-3000:]
    assert losses(run_dir) == reference, (losses(run_dir), reference)


def torchrun(hosts, data, tools, name, port, log) -> list[Launch]:
    return [
        start(
            host,
            [ROOT / "launch" / "torchrun.sh", 1, *train_args(data, name)],
            env_for(tools, NNODES=2, NODE_RANK=i, MASTER_ADDR=ADDRS[0], MASTER_PORT=port, GLOO_SOCKET_IFNAME=IFNAME),
            data,
            f"{log}-{host.hostname}.log",
        )
        for i, host in enumerate(hosts)
    ]


# ----------------------------------------------------------------------------------------------
# The launchers across two hosts


def test_torchrun_across_two_hosts_equals_one_host(hosts, data, tools, reference):
    launches = torchrun(hosts, data, tools, "torchrun", _port(), "torchrun")
    finish(launches)
    assert_same_steps(data / "torchrun", reference, launches)


def test_deepspeed_launcher_without_ssh_across_two_hosts_equals_one_host(hosts, data, tools, reference):
    """launch/multi_node.sh with NODE_RANK set: the DeepSpeed launcher's no-ssh mode, started on each host with the
    same hostfile; the rendezvous address defaults to the hostfile's first host."""
    hostfile = data / "hostfile"
    hostfile.write_text("# the two hosts\n" + "".join(f"{h.hostname} slots=1\n" for h in hosts))
    port = _port()
    launches = [
        start(
            host,
            [ROOT / "launch" / "multi_node.sh", hostfile, *train_args(data, "deepspeed")],
            env_for(tools, NODE_RANK=i, MASTER_PORT=port, GLOO_SOCKET_IFNAME=IFNAME),
            data,
            f"deepspeed-{host.hostname}.log",
        )
        for i, host in enumerate(hosts)
    ]
    finish(launches)
    assert_same_steps(data / "deepspeed", reference, launches)


def test_slurm_script_across_two_hosts_equals_one_host(hosts, data, tools, reference):
    """launch/slurm.sbatch as sbatch runs it: on the allocation's first node, with the batch job's variables of a
    2-node allocation (`sbatch --nodes=2 --ntasks-per-node=1`), its srun starting one task on each node."""
    nodelist = "node[1-2]"
    assert [h.hostname for h in hosts] == ["node1", "node2"]
    batch = env_for(
        tools,
        SLURM_JOB_ID=4242,
        SLURM_JOBID=4242,
        SLURM_JOB_NAME="pretrain",
        SLURM_JOB_NODELIST=nodelist,
        SLURM_NODELIST=nodelist,
        SLURM_NNODES=2,
        SLURM_JOB_NUM_NODES=2,
        SLURM_NTASKS=2,
        SLURM_NPROCS=2,
        SLURM_NTASKS_PER_NODE=1,
        SLURM_TASKS_PER_NODE="1(x2)",
        SLURM_JOB_CPUS_PER_NODE="1(x2)",
        SLURM_CPUS_ON_NODE=1,
        SLURM_NODEID=0,
        SLURM_PROCID=0,
        SLURM_LOCALID=0,
        SLURMD_NODENAME=hosts[0].hostname,
        SLURM_SUBMIT_DIR=data,
        SLURM_SUBMIT_HOST=hosts[0].hostname,
        SLURM_CLUSTER_NAME="netns",
        MASTER_PORT=_port(),
        GLOO_SOCKET_IFNAME=IFNAME,
        FAKE_SLURM_NETNS=" ".join(h.netns for h in hosts),
    )
    launch = start(hosts[0], [ROOT / "launch" / "slurm.sbatch", *train_args(data, "slurm")], batch, data, "slurm.log")
    finish([launch])
    assert_same_steps(data / "slurm", reference, [launch])


# ----------------------------------------------------------------------------------------------
# A host dies


def _wait_for_checkpoint(run_dir: Path, launches: list[Launch]) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not (run_dir / "checkpoints" / "latest").is_file():
        ended = [launch for launch in launches if launch.proc.poll() is not None]
        assert not ended, f"a host stopped before the first checkpoint:\n{ended[0].output()[-4000:]}"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.02)


def test_host_killed_mid_run_ends_the_other_and_the_next_launch_resumes_bitwise(hosts, data, tools, reference):
    run_dir = data / "killed"
    launches = torchrun(hosts, data, tools, "killed", _port(), "killed")
    _wait_for_checkpoint(run_dir, launches)
    # Host 2 loses power: every process on it stopped at once (no step finishes after this), its link cut (so no
    # connection is closed towards host 1: nothing tells host 1 but the collective timeout), then killed.
    victims = hosts[1].pids()
    for pid in victims:
        os.kill(pid, signal.SIGSTOP)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    subprocess.run(hosts[1].exec("ip", "link", "set", IFNAME, "down"), check=True)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = launches[0]
    try:
        survivor.proc.wait(timeout=SURVIVOR_BOUND)
    except subprocess.TimeoutExpired:
        survivor.proc.kill()
        survivor.proc.wait()
        pytest.fail(f"host 1 still running {SURVIVOR_BOUND} s after host 2 died:\n{survivor.output()[-4000:]}")
    waited = time.monotonic() - killed_at
    launches[1].proc.wait(timeout=60)
    subprocess.run(hosts[1].exec("ip", "link", "set", IFNAME, "up"), check=True)  # host 2 is back
    said = survivor.output()
    assert survivor.proc.returncode != 0, said[-4000:]
    assert waited < SURVIVOR_BOUND
    assert "lost contact with another rank" in said and f"its last checkpoint is {run_dir}" in said, said[-4000:]
    step = int(latest.removeprefix("step_"))
    assert 0 < step < STEPS, f"host 2 was killed after the run ended (latest {latest}): nothing to resume"

    # The same launch again, on both hosts: it resumes from that checkpoint and ends where the one-host run did.
    launches = torchrun(hosts, data, tools, "killed", _port(), "resumed")
    finish(launches)
    said = launches[0].output()
    assert "resumed from" in said and f"{latest} (step {step}," in said, said[-4000:]
    assert_same_steps(run_dir, reference, launches)
