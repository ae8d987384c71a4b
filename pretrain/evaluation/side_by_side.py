"""Runs of an ablation side by side (`launch.jobs`): each in a child process of its own, on a GPU of its own where the
host has several (round robin over CUDA_VISIBLE_DEVICES), sharing the one GPU otherwise.

A small encoder's pretraining and, above all, its fine-tunings and probes (tiny batches, launch-bound) leave most
of a GPU idle, and an ablation is many such runs. A child runs one call, `function(*args)` pickled by the parent
(the function by its module and name, so this module imports none of the ablation's code), and reports its end by
its exit status: 0 done, 130 interrupted, else failed with the message it wrote. Its output (and its trainer's)
goes to `<logs>/<name>.log`, which the parent shows as it grows, each line prefixed with the run's name (a progress
bar's updates, a line every 30 s). ^C or SIGTERM to the parent is passed on to every child (each passes it to its
trainer, which saves a checkpoint) and waited for; a child dies with the parent (PR_SET_PDEATHSIG), as an arm's
trainer does.

    python -m pretrain.evaluation.side_by_side CALL MESSAGE PARENT  # a child: CALL a pickled (function, args),
                                                  # MESSAGE where a failure's one-line message goes, PARENT our pid
"""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pretrain.core.errors import UserError

INTERRUPTED = 130  # a child's exit status when it was signalled (as a shell reports ^C)
BAR_EVERY_S = 30.0  # a progress bar's updates reach the parent's output this often


@dataclass
class Job:
    """What one child runs: `function(*args)`, named `name` in the output and the log."""

    name: str
    function: Callable
    args: tuple


def device_slots(jobs: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of `jobs` slots: the visible GPUs round robin where there are several; None (the
    parent's, inherited) where there is one GPU or none, so that the slots share it."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ids = [d.strip() for d in visible.split(",") if d.strip()][:count] if visible is not None else list(range(count))
    if len(ids) <= 1:
        return [None] * jobs
    return [str(ids[slot % len(ids)]) for slot in range(jobs)]


def runs_per_device(jobs: int) -> int:
    """The most runs that share one device when `jobs` run at a time (`device_slots`): their wall times include it."""
    slots = device_slots(jobs)
    return max(slots.count(slot) for slot in slots)


def threads_per_job(threads: int, jobs: int) -> int:
    """Torch threads for each child: `threads` where given, else the cores this process may use (its affinity: a
    Slurm allocation's, not the node's) shared out; each child left at torch's default would take them all."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return threads if threads > 0 else max(1, cores // jobs)


def _die_with(parent: int, prctl) -> None:
    """This process gets SIGTERM when `parent` dies (PR_SET_PDEATHSIG), or at once where it has died already."""
    prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


def terminated_with_parent(parent: int):
    """A preexec_fn: the child gets SIGTERM when `parent` dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing), so an
    ablation killed with -9 leaves no trainer (or side-by-side run) going on, orphaned, holding its arm's lock: the
    trainer saves a checkpoint and exits, and the next `pretrain ablate` resumes it. The signal comes when the thread
    that started the child ends: start it from the main thread."""
    prctl = _prctl()  # looked up here: the child between fork and exec should not load libraries
    return None if prctl is None else (lambda: _die_with(parent, prctl))


class _Child:
    """A running job: its process, the slot it holds, and the thread that relays its output.

    Its output (and its trainer's) goes to its log file, which the relay reads as it grows: never to a pipe, whose
    reader, this process, killed with -9, would leave a trainer stopped by SIGTERM failing to log its stop
    (BrokenPipeError) before it saves its checkpoint; and a relay that failed to print would leave it blocked."""

    def __init__(self, job: Job, slot: int, device: str | None, threads: int, scratch: Path, logs: Path, env: dict):
        self.job, self.slot = job, slot
        self.message = scratch / f"{job.name}.message"
        call = scratch / f"{job.name}.call"
        call.write_bytes(pickle.dumps((job.function, job.args)))
        env = {**env, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        parent = str(os.getpid())  # the child arms its own PR_SET_PDEATHSIG: no preexec_fn while relays run
        command = [sys.executable, "-m", "pretrain.evaluation.side_by_side", str(call), str(self.message), parent]
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{job.name}.log"
        with open(log, "ab") as out:
            reader = open(log, "rb")  # noqa: SIM115 (the relay's, closed there): opened before anything is written
            reader.seek(out.tell())  # a log of an earlier invocation: its lines were shown then
            self.proc = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.relay = threading.Thread(target=_relay, args=(reader, self.proc, job.name), daemon=True)
        self.relay.start()

    def failure(self, returncode: int) -> str:
        """What went wrong, in one line, for a child that ended with `returncode` (not 0, not interrupted)."""
        if self.message.is_file() and self.message.read_text().strip():
            return self.message.read_text().strip()
        if returncode < 0:
            return f"its process was killed by {signal.Signals(-returncode).name}"
        return f"its process exited with status {returncode}"


_print_lock = threading.Lock()


def _relay(log, proc: subprocess.Popen, name: str) -> None:
    """Show a child's output, read from its log (a file open for reading) as it grows until the child has ended, each
    line prefixed `[name] `; of the updates of a progress bar (ended by a carriage return), one every BAR_EVERY_S
    seconds, and the last."""
    pending, bar, shown, quiet = b"", b"", float("-inf"), False

    def emit(text: bytes) -> None:
        nonlocal quiet
        line = text.decode("utf-8", "replace").rstrip()
        if line and not quiet:
            try:
                with _print_lock:
                    try:
                        print(f"[{name}] {line}", flush=True)
                    except UnicodeEncodeError:  # a bar's blocks on an ASCII terminal
                        encoding = getattr(sys.stdout, "encoding", None) or "ascii"
                        print(f"[{name}] {line}".encode(encoding, "replace").decode(encoding), flush=True)
            except (OSError, ValueError):  # our stdout gone (a closed pipe, a full disk): the log still has it all
                quiet = True

    with log as f:
        while True:
            ended = proc.poll() is not None  # read after: what it wrote before it ended is in the file
            chunk = f.read(1 << 16)
            if not chunk:
                if ended:
                    break
                time.sleep(0.1)
                continue
            parts = re.split(rb"(\r|\n)", pending + chunk)
            pending = parts.pop()  # the text after the last end of line: not a line yet
            for text, end in zip(parts[::2], parts[1::2]):
                if end == b"\n":
                    emit(text or bar)  # a bar's "\r\n" ends it on its last state
                    bar = b""
                elif text.strip():
                    bar = text
                    if time.monotonic() - shown >= BAR_EVERY_S:
                        emit(bar)
                        bar, shown = b"", time.monotonic()
    emit(bar + pending)  # the bar's last state, and a last line without an end


def run_jobs(
    jobs: int,
    next_job: Callable[[], Job | None],
    done: Callable[[str, str | None], None],
    threads: int,
    logs: Path,
    env: dict,
) -> bool:
    """Run the jobs `next_job()` gives (None: no more), at most `jobs` at once, each with `threads` torch threads
    (`threads_per_job`), until all have ended; `done(name,
    failure)` is called as each ends (failure: None when it finished, else its one-line message). Returns whether
    the jobs were interrupted: this process signalled (^C, SIGTERM; the running jobs are passed the signal), or a job
    stopped by one of its own (a trainer's SIGTERM). Then no job starts after it, the running ones are waited for,
    and an interrupted job is not reported."""
    devices = device_slots(jobs)
    free = list(range(jobs))
    running: list[_Child] = []
    got: list[int] = []
    more, interrupted = True, False  # next_job may give more; a job stopped by a signal of its own

    def forward(signum, frame):
        got.append(signum)
        for child in running:
            child.proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    scratch = Path(tempfile.mkdtemp(prefix="side-by-side-"))  # the calls, and the failures' messages
    try:
        while running or (more and not (got or interrupted)):
            while free and more and not (got or interrupted):
                job = next_job()
                more = job is not None
                if job is None or got:  # none left, or signalled meanwhile: it does not start
                    break
                slot = free.pop(0)
                running.append(_Child(job, slot, devices[slot], threads, scratch, logs, env))
                if got:  # signalled while it started
                    running[-1].proc.send_signal(got[0])
            time.sleep(0.1)
            for child in [c for c in running if c.proc.poll() is not None]:
                running.remove(child)
                child.relay.join()
                free.append(child.slot)
                code = child.proc.returncode
                if code == 0:
                    done(child.job.name, None)
                elif code == INTERRUPTED or got:
                    interrupted = True  # a job's own stop ends the turns of those not started, as one at a time
                else:
                    done(child.job.name, child.failure(code))
    finally:
        for child in running:  # only where this process itself failed: stop them as a signal would, and wait
            child.proc.send_signal(signal.SIGTERM)
        for child in running:
            child.proc.wait()
            child.relay.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(scratch, ignore_errors=True)
    return bool(got) or interrupted


def one_line(err: BaseException) -> str:
    """A run's failure, as the summary and the report show it."""
    return f"{type(err).__name__}: {err}".splitlines()[0]


def child_main(argv: list[str]) -> int:
    """A child: run the pickled call; write a failure's message where the parent reads it."""
    call, message, parent = Path(argv[0]), Path(argv[1]), int(argv[2])
    prctl = _prctl()
    if prctl is not None:  # dies with the parent, and so (terminated_with_parent) does its trainer
        _die_with(parent, prctl)
    function, args = pickle.loads(call.read_bytes())
    try:
        function(*args)
    except KeyboardInterrupt:
        return INTERRUPTED
    except Exception as err:  # one line for the parent's summary; the traceback for this run's log
        if not isinstance(err, UserError):
            import traceback

            traceback.print_exc()
        message.write_text(one_line(err))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
