"""An ablation's life over days, through `pretrain ablate` as a researcher runs it: one invocation per directory,
interrupted (^C, SIGTERM, kill -9) while an arm trains, seeds added afterwards, a corpus or tokenizer changed under
the same names, and `--print-commands` jobs run by hand. Finished work is reused and never mixed with other data."""

import json
import os
from pathlib import Path

import pytest
from helpers import snapshot, tsv_task

from pretrain.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"


def test_a_second_ablate_in_the_same_directory_is_refused(tmp_path, monkeypatch):
    """Two `pretrain ablate` in one directory evaluated the same run at once, interleaving its state.json, and each
    marked as failed the arms whose trainer the other held (its report saying so of arms that finished). The second
    is now refused at once, naming the holder, and writes nothing."""
    import os
    import subprocess
    import sys

    from pretrain.evaluation import ablate
    from pretrain.evaluation.ablate import run_ablation
    from pretrain.evaluation.ablation_commands import print_commands
    from pretrain.evaluation.ablation_plan import load_ablation

    def went_on(ab):
        raise AssertionError("the second ablate went on")

    monkeypatch.setattr(ablate, "prepare_data", went_on)
    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    ab = load_ablation(tiny, [f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]", f"output_dir={tmp_path / 'ab'}"])
    hold = (
        "import time; from pretrain.core.outputs import exclusive, mark_output\n"
        f"mark_output({str(ab.out)!r}, 'ablation')\n"
        f"with exclusive({str(ab.out)!r}, 'running `pretrain ablate`'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    other = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout.readline().strip() == "held"
        for run in (run_ablation, print_commands):
            with pytest.raises(UserError, match=r"another process is running `pretrain ablate` in .*\(pid "):
                run(ab)
        assert sorted(p.name for p in ab.out.iterdir()) == [".bert-pretrain.json", ".lock"]
    finally:
        other.kill()
        other.wait()


def test_an_interrupted_ablation_lets_the_arms_trainer_save_its_checkpoint(tmp_path, monkeypatch):
    """^C (or SIGTERM) to `pretrain ablate` while an arm trains: subprocess.run killed the trainer 0.25 s later,
    before it could finish its step and save (no checkpoint of a 6-layer arm 11 steps in), and SIGTERM to the ablation
    alone left the trainer training on, orphaned. The signal is now passed on and the trainer waited for; the
    ablation stops there (the later arms wait for the next run)."""
    import os
    import signal
    import sys
    import threading
    import time

    from pretrain.evaluation import ablate
    from pretrain.evaluation.ablation_plan import load_ablation

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    ab = load_ablation(tiny, [f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]", f"output_dir={tmp_path / 'ab'}"])
    ready, saved = tmp_path / "ready", tmp_path / "saved"
    trainer = tmp_path / "trainer"  # stands for `python -m pretrain.cli train`: a checkpoint takes a while to save
    trainer.write_text(
        f"#!{sys.executable}\nimport signal, sys, time\n"
        "def stop(*_):\n"
        f"    time.sleep(1); open({str(saved)!r}, 'w').write('step 11'); sys.exit(75)\n"
        f"signal.signal(signal.SIGINT, stop); open({str(ready)!r}, 'w').close(); time.sleep(30)\n"
    )
    trainer.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(trainer))

    def interrupt():
        while not ready.exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # this process alone, as `kill -INT`; a terminal's ^C reaches both

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        ablate.train_arm(ab, ab.arms[0], tmp_path / "arm.yaml")
    assert saved.read_text() == "step 11"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_print_commands_plans_record_the_flops_the_report_shows(tmp_path, monkeypatch):
    """--print-commands measured a step's FLOPs only for a flops budget: under a tokens or time budget its plan said
    0 FLOPs per step, and the report showed 0 FLOPs (and 0 per token) for every arm trained by those commands. They
    are measured where the data exist, else when `pretrain ablate` takes the trained arm over (step 3)."""
    from pretrain.evaluation import ablate, ablation_commands, ablation_plan
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import read_state

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    args = [f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]", f"output_dir={tmp_path / 'ab'}"]
    for module in (ablation_commands, ablate, ablation_plan):
        monkeypatch.setattr(module, "measure_phase_flops", lambda cfg: [1000])  # a micro-batch of 8
    ab = load_ablation(tiny, args)
    mlm = ab.arms[0]
    ablation_commands.print_commands(ab)  # no data yet: nothing to measure a step on
    assert read_state(mlm)["plan"]["flops_per_step"] == 0

    trained = {"step": 6, "tokens_seen": 3000, "elapsed_s": 1.0}
    monkeypatch.setattr(ablate, "train_arm", lambda ab, arm, cfg_path: trained)
    monkeypatch.setattr(ablate, "_final_losses", lambda cfg: {})
    monkeypatch.setattr(ablate, "_exported", lambda arm, state: True)
    ab = load_ablation(tiny, args)  # step 3: `pretrain ablate` after the jobs
    state = read_state(ab.arms[0])
    ablate._pretrain_arm(ab, ab.arms[0], state, ab.arm_config_path(ab.arms[0]))
    assert read_state(ab.arms[0])["plan"]["flops_per_step"] == 1000
    assert read_state(ab.arms[0])["pretraining"]["flops"] == 6 * 1000

    for name in ("tokenizer/tokenizer.json", "shards/manifest.json"):  # with the data there, measured at once
        (ab.out / name).parent.mkdir(exist_ok=True)
        (ab.out / name).write_text("{}")
    (ab.out / "arms" / "mlm" / "state.json").unlink()
    ablation_commands.print_commands(load_ablation(tiny, args))
    assert read_state(mlm)["plan"]["flops_per_step"] == 1000


def test_an_arm_planned_for_the_printed_jobs_is_planned_again_where_it_trains_in_one_process(tmp_path, monkeypatch):
    """--print-commands plans each arm for launch.procs ranks; an arm `pretrain ablate` then trained here, in one
    process, kept that plan: 3 steps of one rank's batch, half its tokens (1/8 with procs 8), and the report gave the
    planned totals. It is planned again for one process where nothing trained yet; a job's finished arm keeps its
    plan, and one its job has started is refused. Slurm's printed jobs ask for the plan's ranks."""
    from pretrain.evaluation import ablate, ablation_commands, ablation_plan
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import read_state

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    args = [f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]", f"output_dir={tmp_path / 'ab'}", "launch.procs=2"]
    for module in (ablation_commands, ablate, ablation_plan):
        monkeypatch.setattr(module, "measure_phase_flops", lambda cfg: [1000])
    ablation_commands.print_commands(load_ablation(tiny, args))
    ab = load_ablation(tiny, args)
    mlm = ab.arms[0]
    assert read_state(mlm)["plan"]["max_steps"] == 3  # 3072 tokens at 2 x 8 sequences of 64

    trained = {}

    def train(ab, arm, cfg_path):
        trained["steps"] = arm.cfg.train.max_steps
        return {"step": arm.cfg.train.max_steps, "tokens_seen": 1, "elapsed_s": 1.0}

    monkeypatch.setattr(ablate, "train_arm", train)
    monkeypatch.setattr(ablate, "_final_losses", lambda cfg: {})
    monkeypatch.setattr(ablate, "_exported", lambda arm, state: True)
    for started, outcome in (({"step": 1}, "refused"), ({"step": 3}, "kept"), ({}, "planned again")):
        ab = load_ablation(tiny, args)
        arm = ab.arms[0]
        monkeypatch.setattr(ablate, "_trainer_state", lambda cfg, started=started: started)
        state = read_state(arm)
        if outcome == "refused":
            with pytest.raises(UserError, match=r"has started training in one: finish it with its job"):
                ablate._pretrain_arm(ab, arm, state, ab.arm_config_path(arm))
            continue
        ablate._pretrain_arm(ab, arm, state, ab.arm_config_path(arm))
        plan = read_state(arm)["plan"]
        assert (plan["max_steps"], plan["global_batch"]) == ((3, 16) if outcome == "kept" else (6, 8)), outcome
        if outcome == "planned again":
            assert trained["steps"] == 6 and read_state(arm)["pretraining"]["token_slots"] == 3072
        (arm.cfg.run_dir / "state.json").unlink()
        ablation_commands.print_commands(load_ablation(tiny, args))  # the jobs' plan again, for the next case
    # an arm its job trained whose checkpoints are gone since (removed after its export, a record copied back with its
    # hf/ alone): trained, its plan stays that of the job
    arm = load_ablation(tiny, args).arms[0]
    state = {**read_state(arm), "trained": True}
    monkeypatch.setattr(ablate, "_trainer_state", lambda cfg: {})
    ablate._drop_plan_for_other_ranks(load_ablation(tiny, args), arm, state)
    assert (state["plan"]["max_steps"], state["plan"]["global_batch"]) == (3, 16)

    slurm = load_ablation(
        tiny,
        [
            args[0],
            f"output_dir={tmp_path / 'slurm'}",
            "launch.procs=12",
            "launch.scheduler=slurm",
            "budget.amount=30720",
        ],
    )
    jobs = [line for line in ablation_commands.print_commands(slurm) if line.startswith("sbatch")]
    assert jobs and all(
        "--nodes=2 --ntasks=12 --ntasks-per-node=8 --gpus-per-node=8 launch/slurm.sbatch" in j for j in jobs
    )


def test_changed_evaluation_settings_evaluate_again_and_keep_the_pretraining(tmp_path, capsys):
    """eval.epochs changed on a finished ablation was refused with "remove <run> to run it again": the pretraining
    thrown away to score the same weights otherwise. Evaluation settings alone now re-open the evaluation."""
    from pretrain.evaluation.ablate import check_settings, hyperparameters
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import arm_settings, finished, read_state, write_state

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    args = [f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]", f"output_dir={tmp_path / 'ab'}"]
    ab = load_ablation(tiny, args)
    done = {"trained": True, "exported": True, "evaluated": True, "downstream": {"probe": {"a": {}}}}
    for arm in ab.arms:
        write_state(arm, {"settings": arm_settings(ab, arm), **done})
    again = load_ablation(tiny, [*args, "eval.epochs=2"])
    check_settings(again)  # --print-commands, --data-only: nothing evaluates there, nothing is changed
    assert all(read_state(a)["evaluated"] for a in again.arms)
    check_settings(again, reopen=True)
    for arm in again.arms:
        state = read_state(arm)
        assert state["trained"] and "downstream" not in state and not finished(again, state)
        assert state["settings"] == arm_settings(again, arm)
    assert "its pretraining stands" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"ran with other settings \(run.train.lr"):  # the pretraining's: refused
        check_settings(load_ablation(tiny, [*args, "eval.epochs=2", "run.train.lr=0.5"]), reopen=True)
    assert hyperparameters(again.arms[0], {"warmup_steps": 1})["warmup_steps"] == 1  # the plan's cut, not the config's


def test_a_task_that_cannot_be_read_is_refused_before_any_arm_trains(tmp_path, monkeypatch):
    """An empty dev.tsv was read only when each arm had pretrained and exported: every arm failed after its work."""
    from pretrain.evaluation import ablate
    from pretrain.evaluation.ablation_plan import load_ablation

    def went_on(ab):
        raise AssertionError("the ablation went on to build its data")

    monkeypatch.setattr(ablate, "prepare_data", went_on)
    task = tsv_task(tmp_path / "empty-dev", 20)
    (task / "dev.tsv").write_text("")
    ab = load_ablation(
        str(ROOT / "configs" / "ablation-tiny.yaml"), [f"eval.tasks=[{task}]", f"output_dir={tmp_path / 'ab'}"]
    )
    with pytest.raises(UserError, match=r"dev.tsv"):
        ablate.run_ablation(ab)


def test_seeds_added_afterwards_reuse_the_runs_done(tmp_path):
    """A run is named <arm> with one pretraining seed and <arm>-seed<S> with several: adding seeds to a finished
    ablation trained and evaluated every arm again at the seed it had (as mlm-seed1234 beside mlm), and taking them
    away again did the same the other way. A run recorded under the other name at that seed keeps its name."""
    from pretrain.evaluation.ablate import check_settings
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import arm_settings, finished, read_state, write_state
    from pretrain.evaluation.task_files import task_sha256

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    task = tsv_task(tmp_path / "mr", 20)
    arms = "arms={mlm: {objectives: {mlm: {}}}, none: {pretrain: false}}"
    args = [f"eval.tasks=[{task}]", f"output_dir={tmp_path / 'ab'}", arms]
    result = {"task": "mr", "task_sha256": task_sha256(task), "dev_labels": [0, 1] * 10, "dev_predictions": [[0] * 20]}

    def run_all(ab):
        for arm in ab.arms:
            if not read_state(arm):
                write_state(
                    arm, {"settings": arm_settings(ab, arm), "evaluated": True, "downstream": {"probe": {"mr": result}}}
                )

    one = load_ablation(tiny, args)  # run.train.seed 1234 alone
    run_all(one)
    three = load_ablation(tiny, [*args, "seeds=[1234, 1235, 1236]"])
    assert [a.name for a in three.arms if a.group == "mlm"] == ["mlm", "mlm-seed1235", "mlm-seed1236"]
    assert [a.seed for a in three.arms if a.group == "mlm"] == [1234, 1235, 1236]
    check_settings(three)
    assert [finished(three, read_state(a)) for a in three.arms if a.group == "mlm"] == [True, False, False]
    run_all(three)
    back = load_ablation(tiny, [*args, "seeds=[1235]"])  # the other way: one seed, run before under its seed name
    assert [a.name for a in back.arms] == ["mlm-seed1235", "none-seed1235"]
    assert all(finished(back, read_state(a)) for a in back.arms)
    assert [a.name for a in load_ablation(tiny, [*args, "seeds=[1236, 1237]"]).arms][:2] == [
        "mlm-seed1236",
        "mlm-seed1237",
    ]


def test_a_corpus_changed_in_place_is_refused_rather_than_mixed(tmp_path, monkeypatch):
    """The corpus file changed in place (same path, other documents) between two invocations: `prepare_data` built the
    shards again from it and the arms run from then on (one added since) trained on other data than the finished
    ones, in one report. Each run records the content of the shards it trained on; other data now is refused, naming
    the run. A rebuild of the same data (the file touched, or copied to another machine) is no change."""
    from pretrain.core.outputs import mark_output
    from pretrain.evaluation import ablate
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import read_state

    corpus = tmp_path / "corpus.jsonl"
    lines = CORPUS.read_text().splitlines()
    corpus.write_text("\n".join(lines[:12]) + "\n")
    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    args = [
        f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]",
        f"output_dir={tmp_path / 'ab'}",
        f"run.data.corpus=[{corpus}]",
    ]
    ab = load_ablation(tiny, args)
    mark_output(ab.out, "ablation")
    ablate.prepare_data(ab)
    monkeypatch.setattr(ablate, "measure_phase_flops", lambda cfg: [1000])
    monkeypatch.setattr(ablate, "train_arm", lambda ab, arm, cfg_path: {"step": 6, "tokens_seen": 3000})
    monkeypatch.setattr(ablate, "_final_losses", lambda cfg: {})
    monkeypatch.setattr(ablate, "_exported", lambda arm, state: True)
    mlm = ab.arms[0]
    ablate._pretrain_arm(ab, mlm, {}, ab.arm_config_path(mlm))
    assert read_state(mlm)["shards"] == ablate.shards_hash(ab)

    def went_on(ab, arm):
        raise AssertionError(f"{arm.name} ran")

    monkeypatch.setattr(ablate, "run_arm", went_on)
    corpus.touch()  # built again, the same data
    ablate.prepare_data(ab)
    ablate.check_shards(ab)
    corpus.write_text("\n".join(lines[:20]) + "\n")
    with pytest.raises(UserError, match=f"run mlm in {tmp_path / 'ab'} trained on other data than .*{corpus}"):
        ablate.run_ablation(load_ablation(tiny, args))


def test_print_commands_build_the_data_the_config_gives(tmp_path):
    """--print-commands' data commands gave the type and vocabulary size alone: a cased config (min_frequency 3, one
    document per line) got a lowercased tokenizer from them, with the commands' defaults, which the arms then trained
    on and the report described as cased. Each command now carries every setting of the config that it takes."""
    import shlex

    from pretrain.cli import build_parser
    from pretrain.evaluation.ablation_commands import print_commands
    from pretrain.evaluation.ablation_plan import load_ablation

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    settings = {
        "lowercase": False,
        "strip_accents": False,
        "min_frequency": 3,
        "text_field": "body",
        "text_documents": "lines",
        "tokenizer_sample_docs": 50,
        "docs_per_shard": 7,
        "on_bad_document": "error",
        "max_document_bytes": 4096,
    }
    task = f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]"
    ab = load_ablation(
        tiny, [task, f"output_dir={tmp_path / 'ab'}", *(f"run.data.{k}={v}" for k, v in settings.items())]
    )
    d = ab.base.data
    parser = build_parser()
    printed = [line for line in print_commands(ab) if line.startswith(("pretrain tokenizer", "pretrain shards"))]
    tokenizer, shards = (parser.parse_args(shlex.split(line)[1:]) for line in printed)
    assert (tokenizer.type, tokenizer.vocab_size, tokenizer.sample_docs) == (d.tokenizer_type, d.vocab_size, 50)
    for args, keys in (
        (tokenizer, settings.keys() - {"tokenizer_sample_docs", "docs_per_shard"}),
        (shards, ["docs_per_shard"]),
    ):
        for key in keys:
            assert getattr(args, {"on_bad_document": "on_bad"}.get(key, key)) == getattr(d, key) == settings[key], key
    for key in ("text_field", "text_documents", "max_document_bytes"):
        assert getattr(shards, key) == settings[key], key
    assert (Path(tokenizer.out), Path(shards.tokenizer), Path(shards.out)) == (
        ab.base.tokenizer_dir,
        ab.base.tokenizer_dir,
        ab.base.shards_dir,
    )


def test_a_tokenizer_trained_for_other_settings_is_refused(tmp_path):
    """An ablation stopped after its data stage (hours of shards) and run again with data.lowercase=false kept its
    lowercased tokenizer ('exists, skipped': the ablation names its tokenizer, used as it is), and every arm trained
    on it while its settings said cased. The tokenizer's recorded settings are held to the config's."""
    from pretrain.evaluation.ablate import prepare_data
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import write_state

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    args = [f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]", f"output_dir={tmp_path / 'ab'}"]
    ab = load_ablation(tiny, [*args, "run.data.lowercase=false"])
    tok = ab.base.tokenizer_dir
    tok.mkdir(parents=True)
    (tok / "tokenizer.json").write_text("{}")
    (tok / "training_settings.json").write_text(json.dumps({"vocab_size": 512, "lowercase": True}))
    with pytest.raises(UserError, match=rf"data.lowercase=True \(the config gives False\).* Remove {tok} to have it"):
        prepare_data(ab)
    write_state(ab.arms[0], {"plan": {}})
    with pytest.raises(UserError, match=r"the arms mlm trained on it\. Put the config back"):
        prepare_data(ab)

    # the files it read, where no arm trained on it: refused as a setting is (an arm's shards hash holds them after)
    ab = load_ablation(tiny, [*args, "run.data.vocab_size=512", f"output_dir={tmp_path / 'ab2'}"])
    tok = ab.base.tokenizer_dir
    tok.mkdir(parents=True)
    (tok / "tokenizer.json").write_text("{}")
    (tok / "training_settings.json").write_text(json.dumps({"vocab_size": 512, "input_files": [["/gone", 1, 2]]}))
    with pytest.raises(UserError, match=r"corpus files that changed since \(added: .*removed: /gone\).* Remove"):
        prepare_data(ab)


PARENT = """
import subprocess, sys
from pretrain.evaluation.side_by_side import terminated_with_parent
import os
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], preexec_fn=terminated_with_parent(os.getpid()))
print(child.pid, flush=True)
child.wait()
"""

TRAINER = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: (Path(sys.argv[1]).write_text("saved"), sys.exit(75)))
Path(sys.argv[1] + ".started").write_text("")
time.sleep(60)
"""


def test_an_arms_trainer_is_terminated_when_the_ablation_is_killed(tmp_path):
    """kill -9 of `pretrain ablate` left its trainer training on, orphaned, holding the arm's lock; it now gets
    SIGTERM (its handler saves a checkpoint and exits)."""
    import signal
    import subprocess
    import sys
    import time

    flag = tmp_path / "trainer"
    trainer = TRAINER.replace("sys.argv[1]", repr(str(flag)))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, trainer], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while not (tmp_path / "trainer.started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive() -> bool:
        try:
            return "zombie" not in Path(f"/proc/{child}/status").read_text()
        except OSError:  # reaped
            return False

    while (not flag.exists() or alive()) and time.monotonic() < deadline:  # its handler writes, then it exits
        time.sleep(0.05)
    running = alive()
    if running:
        os.kill(child, signal.SIGKILL)
    assert flag.read_text() == "saved" and not running


def test_an_arm_interrupted_mid_interval_reports_the_final_loss_of_one_never_stopped(tmp_path):
    """An arm's final pretraining loss (results.json, the report) is the mean of its last few metrics lines. A trainer
    stopped between two log steps (^C, SIGTERM, a preemption) logs the stop's step alone, and its resumed run keeps that
    line beside the regular ones (test_distributed: the lines of whole intervals are those of a run never stopped):
    the mean took it in, so the same arm reported another final loss for each interruption (log_every 2, stopped at
    step 5 of 6: the mean of steps 4, 5, 6 for that of 2, 4, 6). Only whole intervals, and the run's last line,
    count now."""
    from pretrain.evaluation.ablate import _final_losses
    from pretrain.evaluation.ablation_plan import load_ablation

    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    args = [f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]", f"output_dir={tmp_path / 'ab'}", "run.train.log_every=2"]
    cfg = load_ablation(tiny, args).arms[0].cfg
    line = {2: 6.25, 4: 6.22, 5: 6.14, 6: 6.16, 7: 6.1}  # step 5: the stop's own line (step 5 alone)

    def final(steps):
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps({"step": s, "loss": line[s], "mlm/loss": line[s]}) + "\n" for s in steps)
        (cfg.run_dir / "metrics.jsonl").write_text(text)
        return _final_losses(cfg)

    never_stopped = final([2, 4, 6])
    assert never_stopped["loss"] == pytest.approx((6.25 + 6.22 + 6.16) / 3)
    assert final([2, 4, 5, 6]) == never_stopped
    assert final([2, 4, 6, 7])["loss"] == pytest.approx((6.22 + 6.16 + 6.1) / 3)  # a last line off the interval counts


@pytest.mark.slow
def test_sigterm_to_runs_side_by_side_saves_each_trainer_and_the_same_command_goes_on(tmp_path):
    """`pretrain ablate ... launch.jobs=2` told to stop (SIGTERM to it alone, as `kill` does) while both runs train:
    each run's process passes it to its trainer, which saves a checkpoint, and the ablation exits 130 with no report
    and no trainer left running. The same command again resumes both from their checkpoints and writes the report,
    each run at its full budget."""
    import signal
    import time

    from helpers import run_cli, small_corpus

    from pretrain.train.checkpoint import latest_checkpoint
    from pretrain.train.state import TrainState

    args = [
        "ablate",
        ROOT / "configs" / "ablation-tiny.yaml",
        f"output_dir={tmp_path / 'abl'}",
        f"run.data.corpus=[{small_corpus(tmp_path)}]",
        f"eval.tasks=[{tsv_task(tmp_path / 'a', 20)}]",
        "arms={mlm: {objectives: {mlm: {}}}, span: {objectives: {span: {}}}}",
        "budget.amount=307200",  # 600 steps: far more than the wait below
        "run.train.log_every=20",
        "run.train.save_every=1000",
        "launch.threads=1",
        "launch.jobs=2",
    ]
    proc = run_cli(*args, cwd=ROOT, wait=False)
    metrics = [tmp_path / "abl" / "arms" / arm / "metrics.jsonl" for arm in ("mlm", "span")]
    deadline = time.monotonic() + 300
    while not all(m.is_file() for m in metrics) and time.monotonic() < deadline:  # both past their first log step
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "[mlm] [ablate] arm mlm: stopped by SIGTERM (its checkpoint saved)" in out, out[-3000:]
    assert "[span] [ablate] arm span: stopped by SIGTERM (its checkpoint saved)" in out, out[-3000:]
    assert not (tmp_path / "abl" / "report.md").exists()
    assert not [p for p in Path("/proc").glob("[0-9]*") if _runs_a_trainer_of(p, tmp_path / "abl")]
    stopped_at = {}
    for arm in ("mlm", "span"):
        stopped_at[arm] = TrainState.load(latest_checkpoint(tmp_path / "abl" / "arms" / arm / "checkpoints")).step
        assert 20 <= stopped_at[arm] < 600, stopped_at
    again = run_cli(*args, cwd=ROOT)
    results = json.loads((tmp_path / "abl" / "results.json").read_text())["runs"]
    assert {arm: run["pretraining"]["steps"] for arm, run in results.items()} == {"mlm": 600, "span": 600}
    for arm, step in stopped_at.items():
        assert f"[{arm}] resumed from " in again.stdout and f"(step {step}, " in again.stdout


def _runs_a_trainer_of(proc: Path, ablation: Path) -> bool:
    """Whether /proc/<pid> is a `pretrain.cli train` of a config in `ablation` (gone or unreadable: no)."""
    try:
        command = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"train" in command and any(str(ablation).encode() in part for part in command)


def test_print_commands_of_weighted_sources_in_a_directory_with_a_space(tmp_path, capsys):
    """With data.sources, step 1 printed `pretrain tokenizer` and `pretrain shards` over data.corpus, empty there: a
    usage error, and a flops budget could print no arm until step 1 ran. Step 1 is now `pretrain ablate ...
    --data-only`, which builds the sources' shards and mixture as the ablation does; and every printed path is a shell
    word, spaces and all (the launch lines and step 3's were split at a space)."""
    import shlex

    from helpers import small_corpus

    from pretrain.cli import build_parser, main
    from pretrain.evaluation.ablate import data_only
    from pretrain.evaluation.ablation_commands import print_commands
    from pretrain.evaluation.ablation_plan import load_ablation

    a, b = small_corpus(tmp_path, slice(0, 12), "a.jsonl"), small_corpus(tmp_path, slice(12, 24), "b.jsonl")
    args = [
        f"eval.tasks=[{tsv_task(tmp_path / 'task', 20)}]",
        f"output_dir={tmp_path / 'my ablations'}",
        "run.data.corpus=[]",
        f"run.data.sources=[{{name: a, corpus: [{a}], weight: 0.7}}, {{name: b, corpus: [{b}], weight: 0.3}}]",
    ]
    tiny = str(ROOT / "configs" / "ablation-tiny.yaml")
    first = print_commands(load_ablation(tiny, args))
    step1 = [line for line in first if line.startswith("pretrain ")][0]
    words = shlex.split(step1)
    assert words[1:] == ["ablate", str(tmp_path / "my ablations" / "ablation.yaml"), "--data-only"]
    assert main(words[1:]) == 0 and "is built" in capsys.readouterr().out
    ab = load_ablation(tiny, args)
    assert sorted(p.name for p in ab.base.shards_dir.iterdir() if p.is_dir()) == ["a", "b"]
    again = print_commands(ab)  # the data is there: every arm's flops are measured and its launch line printed
    launches = [shlex.split(line) for line in again if line.startswith("launch/")]
    assert len(launches) == sum(arm.pretrain for arm in ab.arms) > 0
    assert all(Path(words[2]).is_file() and " " in words[2] for words in launches)
    build_parser().parse_args(shlex.split(again[-1])[1:])  # step 3, one path
    assert shlex.split(again[-1])[2] == str(tmp_path / "my ablations" / "ablation.yaml")
    # step 1 again with other data settings, while the printed runs may train on the data: refused, nothing rebuilt
    before = snapshot(ab.base.shards_dir), (ab.out / "ablation.yaml").read_text()
    changed = [*args, "run.data.docs_per_shard=3"]
    with pytest.raises(UserError, match=r"ran with other settings \(run.data.docs_per_shard: 2000 -> 3\)"):
        data_only(load_ablation(tiny, changed))
    assert (snapshot(ab.base.shards_dir), (ab.out / "ablation.yaml").read_text()) == before
