"""Between logging steps a training step never makes the host wait for the device: no code of ours reads a tensor
back (`.item()`, `bool`/`int`/`float` of a tensor, `.tolist()`, `.numpy()`, `nonzero`, boolean-mask indexing),
synchronizes the device, or copies Python data to it; and DeepSpeed, as we configure it, synchronizes nothing
under ZeRO-0 and does not all-reduce the gradients of a single rank.

Counted by benchmarks/step_syncs.py around real optimizer steps of the trainer (`Trainer.train_step` and
`after_step` of the steps that do not log, after the first), for every objective, in fp32 and bf16, with
accumulation and the unpadded encoder, under ZeRO-0 and ZeRO-2, on one rank and on two. On the CPU every read is
visible to a TorchFunctionMode; synchronizations are counted by patching DeepSpeed's accelerator and torch.cuda.
Before asserting, each counter is shown to see what it counts: planted reads and copies in our files, DeepSpeed's
throughput timer and its single-rank all-reduce turned back on. Where CUDA is present, the steps also run under
torch.cuda.set_sync_debug_mode("error"), and a compiled run (inductor, on the CPU too) compiles nothing after its
first step. Nor does the optimizer step walk the module tree on the host
(`test_the_optimizer_step_walks_no_module_tree`).
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_engine_script

from pretrain.train.distributed import single_process_env

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "benchmarks" / "step_syncs.py"
pytestmark = pytest.mark.slow
ONE_RANK = ["mlm-fp32", "mlm-bf16", "span", "rtd", "plm", "sop", "unpadded", "lamb", "zero2", "fp8", "compiled"]
PROBES = ["timers-on", "allreduce-on"]
TWO_RANKS = ["mlm-bf16", "zero2"]


def _env(cpu: bool = True) -> dict:
    env = single_process_env(WANDB_MODE="disabled", DS_ACCELERATOR="cpu")
    if not cpu:  # conftest set DS_ACCELERATOR=cpu for this process: the GPU run's DeepSpeed finds CUDA itself
        del env["DS_ACCELERATOR"]
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("syncs")
    subprocess.run([sys.executable, str(TOOL), "prepare", "--work", str(work)], env=_env(), check=True)
    return work


def _tool(work, runs, ranks=1, cpu=True):
    out = work / f"results-{ranks}-{'cpu' if cpu else 'cuda'}"
    cmd = [str(TOOL), "run", "--work", str(work), "--runs", ",".join(runs), "--out", str(out)]
    if ranks > 1:
        launcher = ["-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(_port())]
        cmd = [*launcher, *cmd]
    proc = subprocess.run([sys.executable, *cmd], env=_env(cpu), cwd=work, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("result-*.json"))]  # ranks share stdout


def _total(counts: dict) -> int:
    return sum(counts.values())


def _check_steps(result: dict, zero0_all_reduces: int | None):
    """Every run: 3 counted steps (2, 4, 5 of 7; 1 warms up), nothing of ours, nothing synchronized by DeepSpeed. At
    ZeRO-0 on one rank no all-reduce either; on two, DeepSpeed's reduction stays."""
    for run in result["runs"]:
        assert run["rc"] == 0 and run["steps"] == 3, run
        assert run["compiles"] == 0, run  # compiled runs (all on a GPU, "compiled" here) compile in the first step only
        assert run["eager_frames"] == 0, run  # and torch left none of their frames eager
        assert run["reads_ours"] == {} and run["h2d_ours"] == {} and run["syncs_ours"] == {}, run
        assert run["syncs_library"] == {}, run  # DeepSpeed's synchronize(), torch.cuda.synchronize()
        if zero0_all_reduces is not None and not run["run"].startswith("zero"):
            assert (run["collectives"].get("all_reduce", 0) > 0) == (zero0_all_reduces > 0), run


def test_no_host_waits_between_logging_steps_on_one_rank(work):
    (result,) = _tool(work, ONE_RANK + PROBES)
    # the counters see what they count: planted reads and copies in our files; DeepSpeed's defaults
    assert result["probes"]["reads_ours"] >= 2 and result["probes"]["h2d_ours"] >= 2, result["probes"]
    runs = {run["run"]: run for run in result["runs"]}
    timers, allreduce = runs.pop("timers-on"), runs.pop("allreduce-on")
    assert timers["rc"] == 0 and allreduce["rc"] == 0
    # DeepSpeed's throughput timer synchronizes at each forward and step() once past its 2 start steps: steps 4
    # and 5 here, 2 micro-batches each
    assert _total(timers["syncs_library"]) == 8, timers
    assert all("deepspeed" in where for where in timers["syncs_library"]), timers
    # its gradient all-reduce on one rank: once per optimizer step (one flat bucket)
    assert allreduce["collectives"].get("all_reduce", 0) == 3, allreduce
    _check_steps({"runs": list(runs.values())}, zero0_all_reduces=0)


def test_no_host_waits_between_logging_steps_on_two_ranks(work):
    results = _tool(work, TWO_RANKS, ranks=2)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        _check_steps(result, zero0_all_reduces=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.set_sync_debug_mode")
def test_no_synchronizing_cuda_operation_between_logging_steps(work):
    """The same steps on the GPU under set_sync_debug_mode("error"): a synchronizing operation of torch anywhere in
    them (ours or DeepSpeed's) raises and fails the run."""
    (result,) = _tool(work, [n for n in ONE_RANK if n != "zero2"], cpu=False)
    assert result["cuda"] and result["probes"]["cuda_sync_debug_raises"], result["probes"]
    _check_steps(result, zero0_all_reduces=0)


WALKS = """
walks = [0]
walk = nn.Module.named_modules
def counting(self, *args, **kwargs):
    walks[0] += 1
    return walk(self, *args, **kwargs)
for step in range(2):
    loss, _ = engine.ds(batch)
    engine.backward(loss)
    nn.Module.named_modules = counting if step == 1 else walk
    engine.step()
    nn.Module.named_modules = walk
assert all(p.grad is None for p in engine.ds.module.parameters())
print("WALKS", walks[0])
"""


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16 on one rank: autocast, DeepSpeed wraps no optimizer
def test_the_optimizer_step_walks_no_module_tree(precision):
    """After each optimizer step DeepSpeed clears the gradients; where it wraps no optimizer it walked every module's
    parameters to do so (`engine.zero_grad_over_a_list`), host work per step that grows with the model. Counted as
    calls of `nn.Module.named_modules` (what every parameter walk goes through) in the second step; the gradients
    are cleared all the same."""
    proc = subprocess.run(
        [sys.executable, "-c", tiny_engine_script(precision) + WALKS],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WALKS 0" in proc.stdout, proc.stdout[-2000:]
