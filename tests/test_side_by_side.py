"""Runs side by side (`launch.jobs`, pretrain/evaluation/side_by_side.py): real child processes running a pickled
call (tests/helpers.py's side_job), at most `jobs` at once; each one's end reported (done, failed with its message,
killed), its output relayed line by line under its name and logged; a signal passed on and waited for; GPUs shared
out round robin. The ablation's own runs side by side, against the same runs one at a time, are in
test_eval_ablation.py."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import side_job

from pretrain.evaluation.side_by_side import Job, device_slots, run_jobs, runs_per_device, threads_per_job
from pretrain.train.distributed import single_process_env

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def child_env() -> dict:
    """The children's environment: they unpickle side_job from tests/helpers.py."""
    env = single_process_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
    return env


def feed(jobs: list[Job], asked: list[str]):
    def next_job():
        if not jobs:
            return None
        asked.append(jobs[0].name)
        return jobs.pop(0)

    return next_job


def test_jobs_run_two_at_a_time_and_each_end_is_reported(tmp_path, capsys):
    m = {name: str(tmp_path / name) for name in "abcd"}
    jobs = [
        Job("a", side_job, (m["a"], 3, 1.0, "", 0, m["b"])),  # a and b meet: side by side however slow to start
        Job("b", side_job, (m["b"], 1, 1.0, "bad input in b.tsv, line 3", 0, m["a"])),
        Job("c", side_job, (m["c"], 1, 0.2)),
        Job("d", side_job, (m["d"], 1, 0.2, "", signal.SIGKILL)),
    ]
    ends: dict[str, str | None] = {}
    asked: list[str] = []
    interrupted = run_jobs(2, feed(jobs, asked), lambda n, f: ends.setdefault(n, f), 1, tmp_path / "logs", child_env())
    assert not interrupted and asked == ["a", "b", "c", "d"]
    assert ends == {
        "a": None,
        "b": "UserError: bad input in b.tsv, line 3",
        "c": None,
        "d": "its process was killed by SIGKILL",
    }
    spans = {n: (float(Path(f"{p}.start").read_text()), float(Path(f"{p}.end").read_text())) for n, p in m.items()}
    at_once = [sum(s <= t < e for s, e in spans.values()) for t, _ in spans.values()]
    assert max(at_once) == 2, spans  # side by side, never more than two
    out = capsys.readouterr().out
    assert "[a] line 0\n[a] line 1\n[a] line 2\n" in out and "[a] last words\n" in out
    # of the bar's updates the first and the last ('\r'-ended, then '\n'-ended) reach the output, not the others
    assert "[a] bar 0/5\n" in out and "[a] bar 5/5\n" in out and "[a] bar 3/5" not in out
    assert "[b] line 0\n" in out and "last words" not in (tmp_path / "logs" / "b.log").read_text()
    # the log has the run's output as it wrote it, every update of its bar included
    bar = "".join(f"\rbar {k}/5" for k in range(6))
    assert (tmp_path / "logs" / "a.log").read_bytes().decode() == f"line 0\nline 1\nline 2\n{bar}\nlast words"


def test_a_job_goes_on_to_its_end_where_its_output_cannot_be_shown(tmp_path, monkeypatch):
    """The output is shown from its log, never through a pipe that the job would block on (or, our process killed,
    fail to write to, before its trainer saves): where showing it fails, the job still ends, and its log has it all."""
    import sys

    class Gone:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Gone())
    ends: dict[str, str | None] = {}
    job = Job("a", side_job, (str(tmp_path / "a"), 10000, 0.0))  # ~90 kB: more than a pipe holds unread
    assert not run_jobs(1, feed([job], []), lambda n, f: ends.setdefault(n, f), 1, tmp_path / "logs", child_env())
    assert ends == {"a": None} and "line 9999\n" in (tmp_path / "logs" / "a.log").read_text()


def test_a_signal_is_passed_on_and_waited_for_and_nothing_more_starts(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    jobs = [Job("a", side_job, (a, 1, 30.0)), Job("b", side_job, (b, 1, 0.0))]
    ends: dict[str, str | None] = {}
    asked: list[str] = []

    def interrupt():
        while not Path(f"{a}.start").exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)  # this process alone, as `kill -TERM`: the child hears it from us

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=interrupt, daemon=True).start()
    started = time.monotonic()
    assert run_jobs(1, feed(jobs, asked), lambda n, f: ends.setdefault(n, f), 1, tmp_path / "logs", child_env())
    assert time.monotonic() - started < 25  # the child stopped when told, not after its 30 s
    assert Path(f"{a}.signalled").read_text() == "SIGTERM" and not Path(f"{a}.end").exists()
    assert asked == ["a"] and ends == {}  # b never started; an interrupted job is not a failure
    assert signal.getsignal(signal.SIGTERM) is before  # put back


def test_a_job_stopped_by_a_signal_of_its_own_ends_the_turns_of_the_rest(tmp_path):
    """A job's trainer stopped by SIGTERM (a job that ends interrupted) stops the jobs not yet started, as one at a
    time stops at an arm interrupted; it is not a failure, and this process was not signalled."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    jobs = [Job("a", side_job, (a, 1, 0.0, "", signal.SIGTERM)), Job("b", side_job, (b, 1, 0.0))]
    ends: dict[str, str | None] = {}
    asked: list[str] = []
    assert run_jobs(1, feed(jobs, asked), lambda n, f: ends.setdefault(n, f), 1, tmp_path / "logs", child_env())
    assert Path(f"{a}.signalled").is_file() and asked == ["a"] and ends == {}


def test_a_job_whose_parent_is_killed_stops_as_told_and_logs_its_stop(tmp_path):
    """kill -9 of the process running the jobs: each job gets SIGTERM (PR_SET_PDEATHSIG) and stops as a trainer does,
    logging its stop, then saving. With its output on a pipe to the dead parent, that log line raised BrokenPipeError
    and the save never came."""
    import subprocess
    import sys

    a = str(tmp_path / "a")
    script = (
        "from pathlib import Path\n"
        "from helpers import side_job\n"
        "from pretrain.evaluation.side_by_side import Job, run_jobs\n"
        f"jobs = [Job('a', side_job, ({a!r}, 1, 60.0))]\n"
        "run_jobs(1, lambda: jobs.pop(0) if jobs else None, lambda n, f: None, 1, "
        f"Path({str(tmp_path / 'logs')!r}), {child_env()!r})\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env=child_env())
    deadline = time.monotonic() + 60
    while not Path(f"{a}.start").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    while not Path(f"{a}.signalled").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Path(f"{a}.signalled").read_text() == "SIGTERM"
    assert "stopping: saving a checkpoint" in (tmp_path / "logs" / "a.log").read_text()


@pytest.mark.parametrize(
    "visible, count, jobs, slots, sharing",
    [
        (None, 0, 3, [None, None, None], 3),  # a CPU: nothing to choose
        (None, 1, 3, [None, None, None], 3),  # one GPU: shared
        (None, 3, 4, ["0", "1", "2", "0"], 2),
        (None, 8, 8, [str(i) for i in range(8)], 1),  # a GPU each: wall times as alone
        ("5,7", 2, 3, ["5", "7", "5"], 2),  # the ids the user made visible, not torch's 0 and 1
    ],
)
def test_gpus_are_shared_out_round_robin(visible, count, jobs, slots, sharing, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert device_slots(jobs) == slots
    assert runs_per_device(jobs) == sharing


def test_threads_are_the_hosts_cores_shared_out_unless_given(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # the cores it may use, not the node's
    assert [threads_per_job(0, jobs) for jobs in (1, 3, 4, 32)] == [16, 5, 4, 1]
    assert threads_per_job(2, 4) == 2


def tiny_ablation(tmp_path, *overrides):
    from helpers import tsv_task

    from pretrain.evaluation.ablation_plan import load_ablation

    task = f"eval.tasks=[{tsv_task(tmp_path / 'task', 20)}]"
    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    return load_ablation(tiny, [task, f"output_dir={tmp_path / 'ab'}", *overrides])


def one_device(monkeypatch):
    """Every run on one device, whatever GPUs the host has (a CPU here)."""
    from pretrain.evaluation import side_by_side

    monkeypatch.setattr(side_by_side, "device_slots", lambda jobs: [None] * jobs)


def test_runs_sharing_a_device_are_expected_to_take_as_long_as_that_many_one_after_another(tmp_path, monkeypatch):
    """--within-minutes judges a run by the runs timed so far, each scaled by how many more runs share a device now
    than when it ran (`timed_seconds`; never scaled down): a run timed alone at 100 s fits 3 minutes one at a time,
    but not two to a device."""
    from pretrain.evaluation import ablate, report
    from pretrain.evaluation.ablation_record import timed_seconds

    alone, shared = {"eval_s": 100.0, "host": {"runs_per_device": 1}}, {"eval_s": 100.0, "host": {"runs_per_device": 2}}
    assert [timed_seconds(alone, 1), timed_seconds(alone, 2), timed_seconds(alone, 4)] == [100.0, 200.0, 400.0]
    assert [timed_seconds(shared, 1), timed_seconds(shared, 2), timed_seconds(shared, 4)] == [100.0, 100.0, 200.0]
    assert timed_seconds({"eval_s": 100.0}, 2) == 200.0  # recorded before launch.jobs: alone
    one_device(monkeypatch)
    monkeypatch.setattr(ablate, "prepare_data", lambda ab: None)
    monkeypatch.setattr(ablate, "check_shards", lambda ab: None)
    monkeypatch.setattr(ablate, "recorded_seconds", lambda ab, sharing: {"mlm": timed_seconds(alone, sharing)})
    monkeypatch.setattr(report, "write_report", lambda ab, results, command: tmp_path / "report.md")
    decided, ran = {}, []

    def side_by_side(ab, sharing, starts, ended):  # what would start, without starting anything
        decided.update({arm.name: starts(i, arm) for i, arm in enumerate(ab.arms, 1)})

    monkeypatch.setattr(ablate, "_side_by_side", side_by_side)
    monkeypatch.setattr(ablate, "run_arm", lambda ab, arm, sharing=1: ran.append(arm.name) or {})
    assert ablate.run_ablation(tiny_ablation(tmp_path, "launch.jobs=2"), within_minutes=3.0) is None
    assert decided == {"mlm": False, "span": False, "none": False} and ran == []  # 2 x 100 s > 180 s
    ablate.run_ablation(tiny_ablation(tmp_path / "alone"), within_minutes=3.0)  # one at a time: 100 s < 180 s
    assert ran == ["mlm", "span", "none"]


def test_a_time_budget_is_refused_where_runs_would_share_a_device(tmp_path, monkeypatch):
    """Under budget.kind=time each run trains for its minutes: two on one device would each get a share of it that
    depends on what the other does meanwhile. Refused, naming the keys, before anything is built."""
    from pretrain.core.errors import ConfigError
    from pretrain.evaluation import ablate

    def went_on(ab):
        raise AssertionError("the ablation went on")

    one_device(monkeypatch)
    monkeypatch.setattr(ablate, "prepare_data", went_on)
    ab = tiny_ablation(tmp_path, "launch.jobs=2", "budget.kind=time", "budget.amount=1")
    shared = r"launch\.jobs=2 would run 2 runs at a time on one device.*budget\.kind=time"
    with pytest.raises(ConfigError, match=shared):
        ablate.run_ablation(ab)
