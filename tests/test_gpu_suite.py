"""benchmarks/gpu_suite.sh: its report reads what every stage writes (here files in the stages' formats, so the test
takes a second; `bash benchmarks/gpu_suite.sh --tiny all` runs the stages themselves on a CPU in minutes), says
which stage failed, and the script refuses an unknown stage."""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_suite.sh"


def _tvh(shape: str, rows: list[tuple[str, float, float]], compiled: bool = False, losses=()) -> dict:
    """A trainer_vs_hf.py --json result: (run, tokens/s, TFLOP/s) per row, the first the reference."""
    meta = {
        "shape": shape,
        "seq": 128,
        "batch": 128,
        "precision": "bf16",
        "vocab": 30522,
        "timed_steps": 100,
        "repeats": 3,
        "device": "1 x NVIDIA H100 80GB HBM3",
        "torch": "2.11",
        "corpus": "en-mix.train.jsonl",
        "command": "python benchmarks/trainer_vs_hf.py ...",
        "ours_compiled": compiled,
    }
    out = [
        {"run": run, "tokens_per_s": rate, "per_repeat": [rate] * 3, "tflops": tf, "mfu": tf / 989.0}
        for run, rate, tf in rows
    ]
    for row, loss in zip(out, losses):
        row["loss"] = loss
    for row in out:
        row["first_over_this"] = out[0]["tokens_per_s"] / row["tokens_per_s"]
    return {"meta": meta, "rows": out, "runs": {}}


def _write_results(res: Path, failed: str = "") -> None:
    files = {
        "base128": _tvh("base", [("ours mlm", 400000.0, 300.0), ("HF Trainer", 200000.0, 250.0)], compiled=True),
        "base128c": _tvh("base", [("ours mlm", 400000.0, 300.0), ("HF Trainer + compile", 250000.0, 280.0)]),
        "base512": _tvh("base", [("ours mlm", 300000.0, 280.0), ("HF Trainer", 150000.0, 200.0)]),
        "rtd": _tvh("mini", [("ours mlm", 2000000.0, 100.0), ("ours rtd", 1000000.0, 90.0)]),
        "nsp": _tvh("base", [("ours mlm", 400000.0, 300.0), ("ours mlm+nsp", 300000.0, 220.0)]),
        "fp8": _tvh("base", [("ours mlm", 400000.0, 300.0), ("ours mlm fp8", 560000.0, 420.0)], losses=(6.1, 6.12)),
        "varlen": {
            "meta": {"command": "python benchmarks/train_throughput.py --shapes padding --device cuda"},
            "rows": [
                {"shape": "padding", "variant": v, "batch": 128, "step_s": 0.1, "tokens_s": r, "tflops": 1.0}
                for v, r in (
                    ("ours padded", 100000.0),
                    ("ours unpadded", 120000.0),
                    ("ours padded, attn dropout 0", 110000.0),
                    ("ours unpadded, attn dropout 0", 165000.0),
                    ("ours + compile", 200000.0),
                )
            ],
        },
        "graphs": {
            "meta": {"command": "python benchmarks/train_throughput.py --shapes mini --device cuda --cuda-graphs"},
            "rows": [
                {"shape": "mini", "variant": v, "batch": 128, "step_s": 0.01, "tokens_s": r, "tflops": 1.0}
                for v, r in (("ours + compile", 1600000.0), ("ours + CUDA graphs", 2000000.0))
            ],
        },
        "local": {
            "meta": {"shape": "base", "seq": 1024, "batch": 16, "unpadded": True, "device": "NVIDIA H100 80GB HBM3"},
            "rows": [{"arm": "global", "tokens_s": 100000.0}, {"arm": "sliding", "tokens_s": 150000.0}],
            "ratio": 1.5,
        },
        "step": {
            "meta": {"command": "python benchmarks/train_throughput.py --device cuda"},
            "rows": [
                {"shape": "base", "variant": v, "batch": 128, "step_s": s, "tokens_s": 16384 / s, "tflops": 1.0}
                | {"mfu": None}
                for v, s in (("HF BertForPreTraining", 0.08), ("ours", 0.04), ("ours + compile", 0.032))
            ],
        },
        "demo": {
            "seconds": 150.0,
            "config": "default-gpu",
            "steps": 4000,
            "max_steps": 4000,
            "tokens": 65536000,
            "tokens_per_s_median": 500000.0,
            "mfu_median": 0.2,
            "train_mlm_loss": 4.1,
            "train_unigram_entropy": 6.5,
            "heldout": "en-mix.valid.jsonl",
            "heldout_mlm_loss": 5.9,
            "heldout_accuracy": 0.2,
            "heldout_unigram_entropy": 7.0,
            "heldout_unigram_cross_entropy": 7.6,
        },
        "eval": {"seconds": 12.0, "samples": 900, "accuracy": 0.2, "loss": 5.9},
        "ablate": {
            "config": "configs/ablation-gpu.yaml",
            "runs": 4,
            "finished": ["mlm-seed1", "mlm-seed2", "rtd-seed1"],
            "new": ["rtd-seed1"],
            "left": ["rtd-seed2"],
            "report": False,
        },
        "finetune": {
            "seconds": 60.0,
            "task": "mr",
            "seeds": [1, 2, 3],
            "main_metric": "accuracy",
            "summary": {"accuracy": {"mean": 0.7, "std": 0.01}},
        },
    }
    for stage, data in files.items():
        (res / f"{stage}.json").write_text(json.dumps(data))
    run = {"run": "mlm", "rc": 0, "steps": 3, "probe": None, "reads_ours": {}, "h2d_ours": {}, "syncs_ours": {}}
    run["syncs_library"] = {}
    timers = run | {"probe": "timers", "syncs_library": {"deepspeed/utils/timer.py:238": 8}}
    # a run that raised under the sync debug mode: rc 1, the steps it counted before
    bad = run | {"run": "rtd", "rc": int(failed == "syncs-run"), "error": "RuntimeError: called a synchronizing op"}
    syncs = {"rank": 0, "world": 1, "cuda": True, "sync_debug": "error", "runs": [run, bad, timers]}
    (res / "syncs.json").write_text(json.dumps(syncs) + "\n")
    (res / "varlen.tests.txt").write_text("11 passed in 9.10s\n")
    for stage in [*files, "syncs"]:
        status = {"stage": stage, "rc": int(stage == failed), "seconds": 42.0, "tiny": False, "gpu": True}
        (res / f"{stage}.stage.json").write_text(json.dumps(status))


def _python(tmp_path: Path, first: str) -> Path:
    """A stand-in for the suite's $PY: a shell script that runs `first` (its own cases), then this Python."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n{first}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def _report(res: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_SUITE_RESULTS": str(res), "PY": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), "report"], env=env, capture_output=True, text=True, timeout=120)


def test_report_reads_every_stage(tmp_path):
    _write_results(tmp_path)
    proc = _report(tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    assert "## GPU suite: 1 x NVIDIA H100" in table and "rehearsal" not in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "| 0, 42 |" in line]
    assert len(rows) == 15, table  # one per stage
    graphs = "BERT-mini, batch 128 | with 2,000,000 vs without 1,600,000 tokens/s (fwd+bwd+AdamW): **1.25x**"
    assert graphs in table
    assert "**2.00x**" in table and "**1.60x**" in table  # ours vs eager, vs compiled
    # the trainer compiled (as on a GPU by default): 400,000 of the compiled model step's 512,000 tokens/s
    assert "model step (ours + compile) 512,000 (batch 128): the trainer at **78%**" in table
    assert "ours rtd costs **2.00x** per token" in table and "MFU 30.3%" in table
    varlen = "parity tests: 11 passed in 9.10s; unpadded 165,000 vs padded 110,000 tokens/s (fwd+bwd+AdamW): **1.50x**"
    varlen += " (with BERT's attention dropout"
    assert varlen + ", in the kernel too: 1.20x; compiled, with it: 200,000)" in table
    assert (
        "base, seq 1024, batch 16, unpadded | sliding 150,000 vs global 100,000 tokens/s (fwd+bwd): **1.50x**" in table
    )
    assert "MLM loss 4.10 vs unigram entropy 6.50" in table and "accuracy 0.700 +- 0.010" in table
    assert "held-out (en-mix.valid.jsonl) 5.90 vs 7.60 from its corpus's frequencies (the text's own: 7.00)" in table
    assert "fp8 560,000 vs bf16 400,000 tokens/s: **1.40x**; final loss 6.120 vs 6.100" in table
    assert "ours 0 (reads, syncs, copies of Python data), DeepSpeed's syncs 0" in table
    assert "(3 steps after the first x 2 micro-batches per run)" in table and "mode 'error' held" in table
    assert "### base512" in table and "### step" in table
    assert "3 of 4 runs finished, 1 in this chunk; left: rtd-seed2 (collect ablation.tgz, carry" in table


def test_report_names_a_failed_stage_and_the_script_refuses_unknown_ones(tmp_path):
    _write_results(tmp_path, failed="rtd")
    proc = _report(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (
        "| rtd | rtd vs mlm: mini, seq 128, batch 128 | **failed** (see rtd.log); what it wrote: ours mlm"
        in proc.stdout
    )
    assert "costs **2.00x** per token | 1, 42 |" in proc.stdout
    _write_results(tmp_path, failed="syncs-run")  # the stage ran, one of its runs raised
    table = _report(tmp_path).stdout
    assert "**failed: rtd** (their errors: syncs.json)" in table and "mode 'error' held" not in table
    bad = subprocess.run(["bash", str(SCRIPT), "nonsense"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown stage" in bad.stderr


def test_a_python_without_deepspeed_stops_the_suite_before_its_first_stage(tmp_path):
    """A lent GPU machine lacking one of DeepSpeed's needs (einops, which ../shared/gpu/prepare.sh does not carry)
    would fail every stage after minutes each: the suite says at once what is missing and how .gpu gets it."""
    python = tmp_path / "python"  # a Python whose `import deepspeed` fails as it did on such a machine
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'einops'\" >&2\nexit 1\n")
    python.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": str(python), "GPU_SUITE_WORK": str(tmp_path / "work")}
    proc = subprocess.run(["bash", str(SCRIPT), "base128", "report"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "No module named 'einops'" in proc.stderr and "bash benchmarks/gpu_prepare.sh" in proc.stderr
    assert not out.exists() or not list(out.iterdir())  # no stage ran
    assert not list((tmp_path / "work").rglob("base128*"))


def _returns(out: Path) -> list[str]:
    """What a lent machine sends back of $OUT, asserting its limits: at most 8 files, 16 MiB each, 64 MiB in all, no
    more than 2 folders down, names of letters, digits, '.', '_' and '-' alone."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    for path in out.rglob("*"):
        rel = path.relative_to(out)
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        assert len(rel.parts) <= (3 if path.is_file() else 2), rel
    assert len(files) <= 8, files
    assert all(p.stat().st_size <= 16 << 20 for p in files) and sum(p.stat().st_size for p in files) <= 64 << 20
    return [str(p.relative_to(out)) for p in files]


def _members(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return [m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()]


def test_a_call_sends_back_one_archive_and_the_report_within_the_limits(tmp_path):
    """The CPU form of a call (three stages of 3 files each were 9 files, one over what a call returns): $OUT gets
    results.tgz and report.md alone, rebuilt after every stage; `collect` unpacks the archive here and reports."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "GPU_SUITE_WORK": str(work)}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--tiny", "local", "report"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _returns(out) == ["report.md", "results.tgz"]
    assert {"local.json", "local.log", "local.stage.json"} <= set(_members(out / "results.tgz"))
    report = (out / "report.md").read_text()
    assert "| local | sliding-window" in report and "tokens/s (fwd+bwd)" in report and report in proc.stdout
    collected = tmp_path / "collected"
    env = {**os.environ, "PY": sys.executable, "GPU_SUITE_RESULTS": str(collected), "GPU_SUITE_WORK": str(work)}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(SCRIPT), "collect", str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (collected / "local.json").is_file() and "| local | sliding-window" in proc.stdout


def test_the_deadline_stops_a_stage_and_skips_those_it_leaves_no_time(tmp_path):
    """GPU_SUITE_DEADLINE (560 s on a GPU call): a stage running at the deadline is stopped, and what it wrote
    before (its JSON, rewritten after every repeat) is in the report with the stop; a stage with too little time
    left is skipped and the report says so; the archive and the report still go back."""
    # the local stage writes its figures, then hangs; everything else is Python's
    result = {"meta": {"shape": "tiny", "seq": 256, "batch": 2}, "rows": [], "ratio": 1.5}
    result["rows"] = [{"arm": "global", "tokens_s": 100.0}, {"arm": "sliding", "tokens_s": 150.0}]
    python = _python(
        tmp_path,
        'if [ "$1" = benchmarks/local_attention.py ]; then\n'
        f"  echo '{json.dumps(result)}' > \"$RESULTS/local.json\"; exec sleep 120\n"
        "fi",
    )
    out, work = tmp_path / "out", tmp_path / "work"
    env = {
        **os.environ,
        "OUT": str(out),
        "PY": str(python),
        "GPU_SUITE_WORK": str(work),
        "RESULTS": str(work / "results"),
    }
    env["GPU_SUITE_DEADLINE"] = "40"  # 25 s of it for the stop and the archive: local gets 15, step none
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--tiny", "local", "step", "report"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert "stage local: exit 124" in proc.stderr and "stopped at the deadline" in proc.stderr
    report = (out / "report.md").read_text()
    assert "**stopped at the deadline** (see local.log); what it wrote: sliding 150 vs global 100" in report
    assert (
        "| step | our trainer vs its own model step alone (train_throughput.py, MLM+NSP, prepared batch) | **skipped**"
        in report
    )
    assert "it needs about 5 s | - |" in report
    assert _returns(out) == ["report.md", "results.tgz"]


def test_the_deadline_counts_from_the_calls_shell(tmp_path):
    """A call's 600 s start with its shell, and `source .gpu/env.sh` installs wheels there before the suite starts:
    with $OUT set, the deadline counts from that shell's start (here 4 s before the suite's), so its stages get
    those seconds less."""
    # the local stage writes its figures at once; everything else is Python's
    python = _python(
        tmp_path,
        'if [ "$1" = benchmarks/local_attention.py ]; then echo \'{"rows": []}\' > "$RESULTS/local.json"; exit 0; fi',
    )
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "PY": str(python), "GPU_SUITE_WORK": str(work)}
    env |= {"RESULTS": str(work / "results"), "GPU_SUITE_DEADLINE": "60"}  # 25 s of it kept for the archive

    def within(command: list[str]) -> int:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return int(re.search(r"stage local \(tiny, CPU\) within (\d+) s", proc.stderr).group(1))

    direct = within(["bash", str(SCRIPT), "--tiny", "local"])  # started by Python, not by a call's shell
    assert 30 <= direct <= 35  # 60 - 25, less the suite's own start (its import check of DeepSpeed)
    # the shell runs something first, as a call's `source .gpu/env.sh; bash ...` does (`; exit` keeps bash from
    # replacing itself with the suite)
    assert direct - within(["bash", "-c", f"sleep 4; bash {SCRIPT} --tiny local; exit $?"]) >= 3


def test_a_failed_demo_is_not_run_again_by_eval_and_finetune(tmp_path):
    """eval and finetune run the demo first where this call has none; where the call's own demo stage failed, running
    it again would spend its minutes twice more for the same failure: they stop at once and say why."""
    # `pretrain.cli run` (the demo) fails, counted; everything else is Python's
    python = _python(tmp_path, 'if [ "$1 $2 $3" = "-m pretrain.cli run" ]; then echo run >> "$COUNT"; exit 3; fi')
    work, count = tmp_path / "work", tmp_path / "count"
    env = {**os.environ, "PY": str(python), "GPU_SUITE_WORK": str(work), "COUNT": str(count)}
    env |= {"GPU_SUITE_RESULTS": str(tmp_path / "res")}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--tiny", "demo", "eval", "finetune"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and count.read_text() == "run\n", proc.stderr[-3000:]
    for stage in ("eval", "finetune"):
        log = (tmp_path / "res" / f"{stage}.log").read_text()
        assert "the demo stage of this call made no export (see demo.log)" in log and "running it first" not in log
    # a call of eval alone still makes its demo first
    proc = subprocess.run(["bash", str(SCRIPT), "--tiny", "eval"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and count.read_text() == "run\nrun\n"
    assert "no demo run here: running it first" in (tmp_path / "res" / "eval.log").read_text()


@pytest.mark.slow
def test_the_ablate_stage_goes_on_from_the_record_an_earlier_machine_sent_back(tmp_path):
    """A lent GPU machine starts bare and keeps nothing: a chunk of the ablation sends back the record of its finished
    runs ($OUT/ablation.tgz, one archive without weights: the record's dozens of files, 3 folders deep, named after
    arms such as mlm+sop, would not come back as files), which `collect` unpacks here as the ablation directory
    that the next machine gets and goes on from."""
    work = tmp_path / "work"
    env = {**os.environ, "PY": sys.executable, "GPU_SUITE_WORK": str(work)}

    def chunk(out: Path, minutes: str) -> dict:
        env_chunk = env | {"OUT": str(out), "GPU_SUITE_ABLATE_MINUTES": minutes}
        proc = subprocess.run(
            ["bash", str(SCRIPT), "--tiny", "ablate"], env=env_chunk, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "ablation.tgz" in _returns(out)
        with tarfile.open(out / "results.tgz") as tar:
            return json.load(tar.extractfile("./ablate.json"))

    first = chunk(tmp_path / "out1", "0.005")  # the first run always starts; the others, judged by it, do not fit
    assert (first["finished"], first["left"], first["report"]) == (["mlm"], ["span", "none"], False)
    record = _members(tmp_path / "out1" / "ablation.tgz")
    assert "arms/mlm/state.json" in record and not [m for m in record if m.endswith(".safetensors")]
    shutil.rmtree(work / "ablation")  # the next machine has only what came back
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--tiny", "collect", str(tmp_path / "out1")],
        env=env | {"GPU_SUITE_RESULTS": str(tmp_path / "collected")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (work / "ablation" / "arms" / "mlm" / "state.json").is_file()
    second = chunk(tmp_path / "out2", "30")
    assert (second["new"], second["left"], second["report"]) == (["span", "none"], [], True)
    with tarfile.open(tmp_path / "out2" / "results.tgz") as tar:
        log = tar.extractfile("./ablate.log").read().decode()
    assert "arm mlm: finished earlier, skipped" in log
    assert "report.md" in _members(tmp_path / "out2" / "ablation.tgz")


def test_a_variant_that_failed_to_compile_leaves_the_others_in_the_report(tmp_path):
    """train_throughput.py keeps timing the other variants when one fails (a compile on the GPU) and writes the
    failure as a row with `error`: the report takes the eager step and says what failed."""
    _write_results(tmp_path)
    error = {"shape": "base", "variant": "ours + compile", "batch": 128, "error": "BackendCompilerFailed: boom"}
    for stage in ("step", "varlen"):
        path = tmp_path / f"{stage}.json"
        result = json.loads(path.read_text())
        result["rows"] = [r for r in result["rows"] if r["variant"] != "ours + compile"] + [error]
        path.write_text(json.dumps(result))
    proc = _report(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model step (ours) 409,600 (batch 128): the trainer at **98%**" in proc.stdout
    assert "in the kernel too: 1.20x; ours + compile failed: BackendCompilerFailed: boom)" in proc.stdout
    assert "| base ours + compile | 128 | failed: BackendCompilerFailed: boom |" in proc.stdout


def test_a_run_torch_left_partly_eager_and_stages_on_other_cards_are_flagged(tmp_path):
    """Ours runs compiled as a user's run is (where a graph fails to compile it runs eager, with torch's warning):
    such a figure is flagged, not read as compiled. Stages collected from calls on different cards say which."""
    _write_results(tmp_path)
    path = tmp_path / "base128.json"
    result = json.loads(path.read_text())
    result["rows"][0]["compile_fallbacks"] = 2
    result["rows"][0]["data_wait"] = 0.031  # ours: the share of its timed seconds it waited for the loader
    path.write_text(json.dumps(result))
    rtd = json.loads((tmp_path / "rtd.json").read_text())
    rtd["rows"][1]["data_wait"] = 0.42
    (tmp_path / "rtd.json").write_text(json.dumps(rtd))
    for status in tmp_path.glob("*.stage.json"):
        st = json.loads(status.read_text())
        st["device"] = "NVIDIA H200" if st["stage"] == "base512" else "NVIDIA H100 80GB HBM3"
        status.write_text(json.dumps(st))
    proc = _report(tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("| base128 |"))
    assert "**2.00x**; **not all compiled**: frames left eager in ours mlm (2)" in line
    assert "**Not all compiled**: frames left eager in ours mlm (2)" in proc.stdout  # under its run table too
    assert "(300 TFLOP/s, MFU 30.3%, waiting for data 3%) vs HF Trainer 200,000 (250 TFLOP/s, MFU 25.3%)" in line
    assert "ours mlm 2,000,000 vs ours rtd 1,000,000, waiting for data 42% real tokens/s" in proc.stdout
    assert "| ours mlm | 400,000 | 400,000 / 400,000 / 400,000 | 300 | 30.3% | - | 1.00x |" in proc.stdout
    assert "## GPU suite: 2 devices (NVIDIA H100 80GB HBM3; NVIDIA H200)" in proc.stdout
    assert "frames left eager" not in next(x for x in proc.stdout.splitlines() if x.startswith("| syncs |"))
    syncs = json.loads((tmp_path / "syncs.json").read_text())
    syncs["runs"][0]["eager_frames"] = 3  # the recompile limit hit in the sync counter's run
    (tmp_path / "syncs.json").write_text(json.dumps(syncs) + "\n")
    line = next(x for x in _report(tmp_path).stdout.splitlines() if x.startswith("| syncs |"))
    assert "; **frames left eager** in mlm (3)" in line
    assert next(x for x in proc.stdout.splitlines() if x.startswith("| base512 |")).endswith("| 0, 42, NVIDIA H200 |")
    assert "not all compiled" not in next(x for x in proc.stdout.splitlines() if x.startswith("| base512 |"))


def test_stages_of_other_commits_or_an_unrecorded_card_are_flagged_and_collect_keeps_a_finished_stage(tmp_path):
    """An earlier session's results (before a fix, with no device in their status) were merged into the new table
    with no word; a call's skipped (or failed) stage replaced a finished one collected before."""
    res = tmp_path / "res"
    res.mkdir()
    _write_results(res)
    for status in res.glob("*.stage.json"):
        st = json.loads(status.read_text())
        if st["stage"] != "step":  # step: an older call's file, which recorded neither
            st |= {"device": "NVIDIA H100 80GB HBM3", "commit": "abc" if st["stage"] == "base128" else "def"}
        status.write_text(json.dumps(st))
    out = _report(res).stdout
    assert "## GPU suite: 2 devices (NVIDIA H100 80GB HBM3; device not recorded)" in out
    assert "**Stages of 3 commits** (abc; commit not recorded; def): compare figures of one commit only" in out

    import tarfile

    sent = tmp_path / "sent"
    sent.mkdir()
    skipped = {"stage": "base128", "rc": 0, "seconds": 0, "tiny": False, "gpu": True, "skipped": "5 s left"}
    (sent / "base128.stage.json").write_text(json.dumps(skipped))
    with tarfile.open(tmp_path / "results.tgz", "w:gz") as tar:
        tar.add(sent / "base128.stage.json", arcname="base128.stage.json")
    (tmp_path / "call").mkdir()
    (tmp_path / "results.tgz").rename(tmp_path / "call" / "results.tgz")
    env = {**os.environ, "PY": sys.executable, "GPU_SUITE_RESULTS": str(res)}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "collect", str(tmp_path / "call")], env=env, capture_output=True, text=True
    )
    assert "collect: base128 kept from the earlier call" in proc.stderr, proc.stderr
    assert (res / "base128.json").is_file() and "skipped" not in (res / "base128.stage.json").read_text()
    # a stage an earlier call skipped is not a finished one: a later call's failure (and its log) replaces it
    (res / "base128.stage.json").write_text(json.dumps(skipped))
    failed = skipped | {"rc": 1}
    failed.pop("skipped")
    (sent / "base128.stage.json").write_text(json.dumps(failed))
    (sent / "base128.log").write_text("Traceback: it broke\n")
    with tarfile.open(tmp_path / "call" / "results.tgz", "w:gz") as tar:
        for name in ("base128.stage.json", "base128.log"):
            tar.add(sent / name, arcname=name)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "collect", str(tmp_path / "call")], env=env, capture_output=True, text=True
    )
    assert "kept from the earlier call" not in proc.stderr and "it broke" in (res / "base128.log").read_text()


@pytest.mark.parametrize(
    "script",
    [
        # a compile error suppressed, as where model.compile is unset and a GPU compiles by default
        "dynamo.config.suppress_errors = True\n"
        "def broken(gm, inputs):\n    raise RuntimeError('no')\n"
        "f = torch.compile(lambda x: x * 2, backend=broken)\nf(torch.ones(3))",
        # the recompile limit hit: the frame runs eager from then on
        "dynamo.config.recompile_limit = 1\n"
        "f = torch.compile(lambda x, n: x * n, backend='eager', dynamic=False)\n"
        "for n in range(3):\n    f(torch.ones(3), n)",
    ],
)
def test_frames_left_eager_are_counted_from_torchs_own_warnings(script):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tvh", ROOT / "benchmarks" / "trainer_vs_hf.py")
    tvh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tvh)
    code = "import torch, torch._dynamo as dynamo\n" + script
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert tvh.compile_fallbacks(proc.stderr) == 1, proc.stderr[-2000:]
    assert tvh.compile_fallbacks("[pretrain] step 10 loss 6.1\n") == 0


def test_medians_take_the_repeats_every_variant_did_and_a_failed_run_leaves_the_others_measured():
    """A cut mid-repeat left ours a median of 2 runs beside the Trainer's 1; a failed compiled run of ours ended the
    stage before the compiled Trainer was measured."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("tvh", ROOT / "benchmarks" / "trainer_vs_hf.py")
    tvh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tvh)
    run = lambda rate: {"tokens_per_s": rate, "tflops": rate / 1000}  # noqa: E731
    rows = tvh.rows_of({"ours": [run(100.0), run(300.0)], "HF Trainer": [run(50.0)]}, None)
    assert [(r["run"], r["tokens_per_s"], r["per_repeat"]) for r in rows] == [
        ("ours", 100.0, [100.0]),
        ("HF Trainer", 50.0, [50.0]),
    ]
    saved = []

    def ours(*args, **kw):
        raise SystemExit("compile failed")

    tvh.run_ours, tvh.run_peer = ours, lambda *args, **kw: run(10.0)
    a = SimpleNamespace(repeats=2, objectives="mlm", fp8=False)
    with pytest.raises(SystemExit, match="ours mlm: compile failed"):
        tvh.measure(a, None, None, None, None, ["compile"], lambda runs, error=None: saved.append((runs, error)))
    runs, error = saved[-1]
    assert len(runs["HF Trainer + compile"]) == 2 and "ours mlm: compile failed" in error


def test_a_missing_or_failed_row_reads_failed_and_the_other_lines_stay(tmp_path):
    """Every line of the report reads only what it needs: a run or variant missing from its stage's file (it failed,
    or the deadline stopped the stage before it) says 'failed' with the recorded reason, or 'not measured'; a file
    of another shape says so in its line; no line takes the table down."""
    _write_results(tmp_path)

    def edit(stage: str, change) -> None:
        path = tmp_path / f"{stage}.json"
        result = json.loads(path.read_text())
        change(result)
        path.write_text(json.dumps(result))

    oom = {"shape": "base", "variant": "HF BertForPreTraining", "batch": 128, "error": "OutOfMemoryError: CUDA"}
    edit("step", lambda r: r.update(rows=[x for x in r["rows"] if not x["variant"].startswith("HF")] + [oom]))
    edit("varlen", lambda r: r.update(rows=[x for x in r["rows"] if x["variant"] != "ours unpadded"]))
    # trainer_vs_hf.py saved after our run, then the Trainer's failed: one row and meta.error
    edit("base512", lambda r: (r.update(rows=r["rows"][:1]), r["meta"].update(error="HF Trainer: exit 1\nOOM")))
    edit("rtd", lambda r: r.update(rows=r["rows"][:1]))
    edit("local", lambda r: r.update(rows=r["rows"][:1]))
    graphs_failed = {"shape": "mini", "variant": "ours + CUDA graphs", "batch": 128, "error": "RuntimeError: replay"}
    edit("graphs", lambda r: r.update(rows=r["rows"][:1] + [graphs_failed]))
    edit("finetune", lambda r: r.pop("summary"))
    (tmp_path / "demo.json").write_text('{"seconds": ')  # cut mid-write by hand
    proc = _report(tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    assert len([line for line in table.splitlines() if line.startswith("| ") and "| 0, 42 |" in line]) == 15, table
    assert "the trainer at **78%** of it; HF BertForPreTraining failed: OutOfMemoryError: CUDA" in table
    assert "in the kernel too: not measured; compiled, with it: 200,000)" in table
    assert "**1.50x** (with BERT's attention dropout" in table
    assert "BERT-mini, batch 128 | failed: RuntimeError: replay |" in table
    assert "ours mlm 300,000 tokens/s, MFU 28.3%; the other run failed: OOM" in table
    assert "| rtd | rtd vs mlm: mini, seq 128, batch 128 | not measured (of its two runs, 1 measured) |" in table
    assert "global 100,000 tokens/s; the other arm not measured" in table
    assert "finetune.json not readable here (KeyError: 'summary')" in table
    assert "demo.json unreadable: " in table
    assert "### base128" in table and "### step" in table
    # the step stage without our model step: said, and BertForPreTraining's stays
    edit("step", lambda r: r.update(rows=[x for x in r["rows"] if x["variant"] in ("HF BertForPreTraining",)]))
    table = _report(tmp_path).stdout
    assert "our model step not measured; HF BertForPreTraining failed: OutOfMemoryError: CUDA" in table


def test_varlen_says_what_its_tests_did_and_fails_on_a_skip_on_a_gpu(tmp_path):
    """The varlen line said 'parity tests passed' even where the CUDA tests skipped (a torch without the kernel's
    window support): it now gives pytest's summary, and on a GPU a skip fails the stage."""
    _write_results(tmp_path)
    (tmp_path / "varlen.tests.txt").write_text("6 passed, 5 skipped in 2.00s\n")
    status = {"stage": "varlen", "rc": 1, "seconds": 42.0, "tiny": False, "gpu": True}
    (tmp_path / "varlen.stage.json").write_text(json.dumps(status))
    table = _report(tmp_path).stdout
    assert "| varlen | unpadded encoder" in table and "**failed** (see varlen.log); what it wrote: " in table
    assert "parity tests: 6 passed, 5 skipped in 2.00s; unpadded" in table and "passed;" not in table
    # the stage on a machine where nvidia-smi finds a GPU and the CUDA tests skip: it fails, saying why
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    python = bin_ / "python"  # the measurement is not what this checks: its file, at once
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = benchmarks/train_throughput.py ]; then\n'
        '  echo \'{"meta": {}, "rows": []}\' > "$RESULTS/varlen.json"; exit 0\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    for tool in bin_.iterdir():
        tool.chmod(0o755)
    work = tmp_path / "work"
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "PY": str(python), "GPU_SUITE_WORK": str(work)}
    env |= {"GPU_SUITE_RESULTS": str(work / "results"), "RESULTS": str(work / "results"), "DS_ACCELERATOR": "cpu"}
    # as after .gpu/env.sh (its site directory on the path): a checkout holding a .gpu is not set up again here
    env["PYTHONPATH"] = f"/tmp/site:{os.environ.get('PYTHONPATH', '')}"
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(SCRIPT), "varlen"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "varlen: tests skipped on a GPU" in proc.stderr, proc.stderr
    assert " skipped in " in (work / "results" / "varlen.tests.txt").read_text()


def test_trainer_vs_hf_refuses_steps_that_would_make_ours_log_every_step(tmp_path):
    """Ours logs (reads the device) every gcd(--warm, timed steps) steps, the peer never: --steps 100 --warm 33
    timed ours reading the device at every step."""
    script = ROOT / "benchmarks" / "trainer_vs_hf.py"
    args = ["--steps", "100", "--warm", "33", "--peers", "none", "--work", str(tmp_path)]
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ours would log every 1 step(s)" in proc.stderr, proc.stderr[-2000:]
