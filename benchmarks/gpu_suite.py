"""The Python half of benchmarks/gpu_suite.sh: the demo's summary, and the markdown report of a results directory.

python benchmarks/gpu_suite.py report RESULTS_DIR
python benchmarks/gpu_suite.py demo-summary --run RUN_DIR --heldout FILE --seconds S --json OUT
python benchmarks/gpu_suite.py add-seconds FILE.json SECONDS
python benchmarks/gpu_suite.py ablation-progress [--before FILE] --json OUT CONFIG [key=value ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # not benchmarks/: its data_pipeline.py would hide the package

STAGES = [
    *("syncs", "base128", "base128c", "step", "base512", "rtd", "nsp", "fp8", "varlen", "graphs", "local"),
    *("demo", "eval", "finetune", "ablate"),
]


def demo_summary(run: Path, heldout: Path, seconds: float, max_samples: int) -> dict:
    """The demo's MLM loss against the unigram plateau (the loss of predicting every masked token from word
    frequencies alone): at the end of training on its own corpus, and on held-out text through `pretrain eval`. On
    held-out text of other kinds than the corpus, a model that learned frequencies alone scores the cross-entropy of
    that text under the corpus's frequencies; the text's own entropy, frequencies the model never saw, is beside it."""
    from data_pipeline.shards import ShardSet, unigram_cross_entropy, unigram_entropy
    from data_pipeline.tokenizer import load_tokenizer, special_tokens
    from pretrain.evaluation.evaluate import evaluate_mlm
    from pretrain.train.metrics import read_metrics
    from pretrain.train.setup import load_checkpoint_model

    records = read_metrics(run)
    cfg = load_checkpoint_model(run)[0]
    tokenizer = load_tokenizer(cfg.tokenizer_dir)
    specials = special_tokens(tokenizer).special_ids
    last = [r for r in records if "mlm/loss" in r][-3:]
    held = evaluate_mlm(run / "hf", corpus=[str(heldout)], max_samples=max_samples)
    train_shards, held_shards = ShardSet(cfg.shards_dir, verify=False), ShardSet(Path(held["shards"]), verify=False)
    return {
        "seconds": seconds,
        "config": cfg.name,
        "steps": records[-1]["step"],
        "max_steps": cfg.train.max_steps,
        "tokens": records[-1]["tokens"],
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in records),
        "mfu_median": statistics.median(r["mfu"] for r in records) if "mfu" in records[-1] else None,
        "train_mlm_loss": sum(r["mlm/loss"] for r in last) / len(last),
        "train_unigram_entropy": unigram_entropy(train_shards, specials),
        "heldout": str(heldout),
        "heldout_mlm_loss": held["loss"],
        "heldout_accuracy": held["accuracy"],
        "heldout_unigram_entropy": unigram_entropy(held_shards, specials),
        "heldout_unigram_cross_entropy": unigram_cross_entropy(train_shards, held_shards, len(tokenizer), specials),
    }


def ablation_progress(config: str, overrides: list[str], before: Path | None) -> dict:
    """How far the ablation that the `ablate` stage works on in chunks has come: its runs, those finished (and, given
    the progress written before the chunk, those the chunk finished), those left, and whether its report is written."""
    from pretrain.evaluation.ablation_plan import load_ablation
    from pretrain.evaluation.ablation_record import finished, read_state

    ab = load_ablation(config, overrides)
    done = [arm.name for arm in ab.arms if finished(ab, read_state(arm))]
    earlier = json.loads(before.read_text())["finished"] if before and before.is_file() else []
    left = [arm.name for arm in ab.arms if arm.name not in done]
    return {
        "config": config,
        "runs": len(ab.arms),
        "finished": done,
        "new": [name for name in done if name not in earlier],
        "left": left,
        "report": not left and (ab.out / "report.md").is_file(),
    }


def _load(path: Path):
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if path.suffix == ".json" and "\n{" in text:  # one JSON object per rank
        return [json.loads(line) for line in text.splitlines()]
    return json.loads(text)


def _get(d, key: str):
    """d[key] where d is a dict (a stage's JSON), else None."""
    return d.get(key) if isinstance(d, dict) else None


def _rate(x: float) -> str:
    return f"{x:,.0f}"


def _wait(row: dict) -> str:
    """', waiting for data x%': the share of our timed seconds the loop waited for the loader (ours only)."""
    return f", waiting for data {row['data_wait']:.0%}" if row.get("data_wait") is not None else ""


def _mfu(row: dict) -> str:
    return (f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else "") + _wait(row)


def _timed(rows: list[dict]) -> list[dict]:
    """train_throughput.py's rows that were timed (a variant that failed has an `error` instead)."""
    return [r for r in rows if "error" not in r]


def _failed(d: dict, name: str = "") -> str:
    """'failed' and the reason the stage's JSON recorded: a row's `error` (train_throughput.py) or meta's (a run
    of trainer_vs_hf.py that failed ends the measurement), else that the run is missing."""
    rows = [r for r in d.get("rows", []) if "error" in r and (not name or r.get("variant", r.get("run")) == name)]
    if rows:
        return f"failed: {rows[0]['error']}"
    error = (d.get("meta") or {}).get("error")
    return f"failed: {error.strip().splitlines()[-1]}" if error else "not measured"


def _eager_runs(runs: list[dict]) -> list[str]:
    """step_syncs.py's runs in which torch left frames eager (a recompile limit hit, a compile error suppressed)."""
    return [f"{x['run']} ({x['eager_frames']})" for x in runs if x.get("eager_frames")]


class Report:
    """The results directory's files, read once; one method per stage line returns (what was measured, result).
    Each reads only what it needs and says 'failed' where a row is missing: one stage's bad or partial file leaves
    the others' lines."""

    def __init__(self, res: Path):
        self.res, self.stages, self.data, self.unreadable = res, {}, {}, {}
        for s in STAGES:
            for kind, into in ((".stage.json", self.stages), (".json", self.data)):
                try:
                    into[s] = _load(res / f"{s}{kind}")
                except (OSError, ValueError) as err:  # edited or cut by hand: the line says so
                    into[s], self.unreadable[s] = None, f"{s}{kind} unreadable: {err}"

    def shape(self, stage: str, default: str) -> str:
        """What the stage ran, from what it wrote: 'base, seq 128, batch 128'."""
        m = _get(self.data[stage], "meta") or {}
        return f"{m['shape']}, seq {m['seq']}, batch {m['batch']}" if {"shape", "seq", "batch"} <= m.keys() else default

    def versus(self, stage: str, what: str) -> tuple[str, str]:
        """trainer_vs_hf.py: its first row (ours) against its last (the peer), or what of them ran."""
        what = f"{self.shape(stage, what.split(': ')[0])}: {what.split(': ')[1]}"
        d = self.data[stage]
        if not d:
            return what, "-"
        rows = d["rows"]
        if len(rows) < 2:
            done = "; ".join(f"{r['run']} {_rate(r['tokens_per_s'])} tokens/s{_mfu(r)}" for r in rows)
            return what, (done + "; " if done else "") + f"the other run {_failed(d)}"
        ours, peer = rows[0], rows[-1]
        return what, (
            f"{ours['run']} {_rate(ours['tokens_per_s'])} tokens/s ({ours['tflops']:.3g} TFLOP/s{_mfu(ours)}) vs "
            f"{peer['run']} {_rate(peer['tokens_per_s'])} ({peer['tflops']:.3g} TFLOP/s{_mfu(peer)}): "
            f"**{peer['first_over_this']:.2f}x**"
        )

    def syncs(self) -> tuple[str, str]:
        what = "host waits in the steps that do not log"
        d = self.data["syncs"]
        syncs = [d] if isinstance(d, dict) else d  # one line per rank
        if not syncs:
            return what, "-"
        r = syncs[0]
        normal = [x for x in r["runs"] if not x["probe"]]
        ours = sum(sum(x[k].values()) for x in normal for k in ("reads_ours", "h2d_ours", "syncs_ours"))
        ds = sum(sum(x["syncs_library"].values()) for x in normal)
        probes = {x["probe"]: x for x in r["runs"] if x["probe"]}
        timers = sum(probes["timers"]["syncs_library"].values()) if "timers" in probes else "-"
        failed = [x["run"] for x in r["runs"] if x["rc"] != 0]
        debug = f"; CUDA sync debug mode '{r['sync_debug']}' held" if r["cuda"] and not failed else ""
        steps = max((x["steps"] for x in normal), default=0)
        # older results have neither: compiles in counted steps, inductor's first-run autotuning syncs
        compiles = sum(x.get("compiles", 0) for x in normal)
        compiler = sum(sum(x.get("syncs_compiler", {}).values()) for x in normal)
        return (
            f"{what} ({steps} steps after the first x 2 micro-batches per run)",
            f"{len(normal)} runs: ours {ours} (reads, syncs, copies of Python data), DeepSpeed's syncs {ds} "
            f"(with its throughput timer back on: {timers}){debug}; compiles in those steps {compiles}, "
            f"inductor's syncs (a kernel's first-run autotuning) {compiler}"
            + (f"; **failed: {', '.join(failed)}** (their errors: syncs.json)" if failed else "")
            + (f"; **frames left eager** in {', '.join(eager)}" if (eager := _eager_runs(r["runs"])) else ""),
        )

    def step(self) -> tuple[str, str]:
        what = "our trainer vs its own model step alone (train_throughput.py, MLM+NSP, prepared batch)"
        step, base = self.data["step"], self.data["base128"]
        if not step:
            return what, "-"
        timed = {r["variant"]: r for r in _timed(step["rows"])}
        # the model step as the trainer ran it, compiled or not; a variant that failed (its compile) falls back
        variant = "ours + compile" if (_get(base, "meta") or {}).get("ours_compiled") else "ours"
        ours = timed.get(variant) or timed.get("ours")
        hf = next((r for v, r in timed.items() if v.startswith("HF")), None)
        trainer = base["rows"][0] if base and base.get("rows") else None
        parts = []
        if trainer and ours:
            parts.append(
                f"trainer {_rate(trainer['tokens_per_s'])} tokens/s vs model step ({ours['variant']}) "
                f"{_rate(ours['tokens_s'])} (batch {ours['batch']}): the trainer at "
                f"**{trainer['tokens_per_s'] / ours['tokens_s']:.0%}** of it"
            )
        elif ours:
            parts.append(f"model step ({ours['variant']}) {_rate(ours['tokens_s'])} tokens/s (batch {ours['batch']})")
            parts.append(f"the trainer {'not measured (base128)' if not trainer else ''}".strip())
        else:
            parts.append(f"our model step {_failed(step, 'ours')}")
        hf_name = "HF BertForPreTraining"
        parts.append(
            f"BertForPreTraining's step {_rate(hf['tokens_s'])}" if hf else f"{hf_name} {_failed(step, hf_name)}"
        )
        return what, "; ".join(parts)

    def pair(self, stage: str, what: str) -> tuple[str, str]:
        """rtd, nsp: the second objective's cost per token against the first's."""
        what = f"{what.split(': ')[0]}: {self.shape(stage, what.split(': ')[1])}"
        d = self.data[stage]
        if not d:
            return what, "-"
        if len(d["rows"]) < 2:
            return what, f"{_failed(d)} (of its two runs, {len(d['rows'])} measured)"
        a, b = d["rows"][0], d["rows"][1]
        return what, (
            f"{a['run']} {_rate(a['tokens_per_s'])}{_wait(a)} vs {b['run']} {_rate(b['tokens_per_s'])}{_wait(b)} "
            "real tokens/s: "
            f"{b['run']} costs **{a['tokens_per_s'] / b['tokens_per_s']:.2f}x** per token"
        )

    def fp8(self) -> tuple[str, str]:
        what = f"train.precision=fp8 vs bf16: {self.shape('fp8', 'BERT-base, seq 128, batch 128')}"
        d = self.data["fp8"]
        if not d:
            return what, "-"
        if len(d["rows"]) < 2:
            return what, f"fp8 {_failed(d)} (of its two runs, {len(d['rows'])} measured)"
        bf16, f8 = d["rows"][0], d["rows"][1]
        loss = f"; final loss {f8['loss']:.3f} vs {bf16['loss']:.3f}" if f8.get("loss") and bf16.get("loss") else ""
        return what, (
            f"fp8 {_rate(f8['tokens_per_s'])} vs bf16 {_rate(bf16['tokens_per_s'])} tokens/s: "
            f"**{f8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x**{loss}"
        )

    def graphs(self) -> tuple[str, str]:
        """CUDA graphs (compile_mode=reduce-overhead) against the default compile, where launches set the pace."""
        d = self.data["graphs"]
        shape = next((f"BERT-{r['shape']}, batch {r['batch']}" for r in (_get(d, "rows") or [])), "BERT-mini")
        what = f"our model step compiled with CUDA graphs (reduce-overhead) vs without: {shape}"
        if not d:
            return what, "-"
        rate = {r["variant"]: r["tokens_s"] for r in _timed(d["rows"])}
        plain, graphs = "ours + compile", "ours + CUDA graphs"
        if plain not in rate or graphs not in rate:
            return what, _failed(d, plain if plain not in rate else graphs)
        return what, (
            f"with {_rate(rate[graphs])} vs without {_rate(rate[plain])} tokens/s (fwd+bwd+AdamW): "
            f"**{rate[graphs] / rate[plain]:.2f}x**"
        )

    def varlen(self) -> tuple[str, str]:
        what = "unpadded encoder on flash's varlen kernel (parity tests, then 40% padding, BERT-mini, attn dropout 0)"
        d = self.data["varlen"]
        if not d:
            return what, "-"
        rate = {r["variant"]: r["tokens_s"] for r in _timed(d["rows"])}

        def ratio(a: str, b: str) -> str:
            return (
                f"{rate[a] / rate[b]:.2f}x" if a in rate and b in rate else f"{_failed(d, a if a not in rate else b)}"
            )

        pad0, unpad0 = "ours padded, attn dropout 0", "ours unpadded, attn dropout 0"
        head = (
            f"unpadded {_rate(rate[unpad0])} vs padded {_rate(rate[pad0])} tokens/s (fwd+bwd+AdamW): "
            f"**{ratio(unpad0, pad0)}**"
            if pad0 in rate and unpad0 in rate
            else f"unpadded vs padded, attn dropout 0: {ratio(unpad0, pad0)}"
        )
        failed = [r for r in d["rows"] if "error" in r and r["variant"] not in (pad0, unpad0)]
        tests = self.res / "varlen.tests.txt"  # pytest's summary: on a GPU a skip fails the stage
        tests = tests.read_text().strip() if tests.is_file() else "not run"
        cuda = " (on a CPU: the CUDA tests skip)" if "skipped" in tests and not self.stages["varlen"].get("gpu") else ""
        return what, (
            f"parity tests: {tests}{cuda}; {head} (with BERT's attention dropout, in the kernel too: "
            f"{ratio('ours unpadded', 'ours padded')}"
            + (f"; compiled, with it: {_rate(rate['ours + compile'])}" if "ours + compile" in rate else "")
            + "".join(f"; {r['variant']} failed: {r['error']}" for r in failed)
            + ")"
        )

    def local(self) -> tuple[str, str]:
        what = "sliding-window (128, every 3rd layer global) vs global attention, ModernBERT-style encoder"
        d = self.data["local"]
        if not d:
            return what, "-"
        m, rate = d.get("meta") or {}, {r["arm"]: r["tokens_s"] for r in d.get("rows", [])}
        if {"shape", "seq", "batch"} <= m.keys():
            what = f"{what}: {m['shape']}, seq {m['seq']}, batch {m['batch']}"
            if m.get("unpadded"):  # as modernbert-base trains: flash's variable-length kernel on CUDA
                what += ", unpadded"
        if "sliding" not in rate or "global" not in rate or "ratio" not in d:
            done = "; ".join(f"{arm} {_rate(r)} tokens/s" for arm, r in rate.items())
            return what, (done + "; " if done else "") + "the other arm not measured"
        return what, (
            f"sliding {_rate(rate['sliding'])} vs global {_rate(rate['global'])} tokens/s (fwd+bwd): "
            f"**{d['ratio']:.2f}x**"
        )

    def demo(self) -> tuple[str, str]:
        demo = self.data["demo"]
        if not demo:
            return "`make demo`, end to end", "-"
        return f"`make demo` ({demo['config']}), end to end", (
            f"{demo['seconds']:.0f} s, step {demo['steps']}/{demo['max_steps']}, {demo['tokens']:,} tokens "
            f"({_rate(demo['tokens_per_s_median'])} tokens/s"
            + (f", MFU {demo['mfu_median']:.1%}" if demo.get("mfu_median") is not None else "")
            + f"); MLM loss {demo['train_mlm_loss']:.2f} vs unigram entropy {demo['train_unigram_entropy']:.2f} "
            f"on its corpus; held-out ({Path(demo['heldout']).name}) {demo['heldout_mlm_loss']:.2f} vs "
            f"{demo['heldout_unigram_cross_entropy']:.2f} from its corpus's frequencies (the text's own: "
            f"{demo['heldout_unigram_entropy']:.2f}), accuracy {demo['heldout_accuracy']:.3f}"
        )

    def eval(self) -> tuple[str, str]:
        ev = self.data["eval"]
        return "`pretrain eval` of the demo's export, en-mix.valid", (
            f"{ev['seconds']:.0f} s, {ev['samples']} sequences, accuracy {ev['accuracy']:.3f}, loss {ev['loss']:.2f}"
            if ev
            else "-"
        )

    def finetune(self) -> tuple[str, str]:
        ft = self.data["finetune"]
        if not ft:
            return "`pretrain finetune` of the demo's export", "-"
        s = ft["summary"][ft["main_metric"]]
        return f"`pretrain finetune` of the demo's export, {ft['task']}", (
            f"{ft['seconds']:.0f} s, {ft['main_metric']} {s['mean']:.3f} +- {s['std']:.3f} over seeds {ft['seeds']}"
        )

    def ablate(self) -> tuple[str, str]:
        ab = self.data["ablate"]
        if not ab:
            return "`pretrain ablate`, one chunk", "-"
        left = (
            "every run done: the report is report.md in the record (ablation.tgz)"
            if ab["report"]
            else f"left: {', '.join(ab['left'])} (collect ablation.tgz, carry runs/ablation-gpu to the next chunk)"
        )
        return f"`pretrain ablate {ab['config']}`, one chunk (--within-minutes)", (
            f"{len(ab['finished'])} of {ab['runs']} runs finished, {len(ab['new'])} in this chunk; {left}"
        )

    def lines(self, fallbacks) -> list[tuple[str, str, str]]:
        """(stage, what, result) per stage; a line that cannot be read from its file says why, the others stay.
        fallbacks: trainer_vs_hf.fallbacks, what a stage's runs left uncompiled, in words."""
        readers = {
            "syncs": self.syncs,
            "base128": lambda: self.versus("base128", "BERT-base, seq 128, batch 128: ours vs Trainer (eager)"),
            "base128c": lambda: self.versus(
                "base128c", "BERT-base, seq 128, batch 128: ours vs Trainer + torch.compile"
            ),
            "step": self.step,
            "base512": lambda: self.versus("base512", "BERT-base, seq 512, batch 32: ours vs Trainer (eager)"),
            "rtd": lambda: self.pair("rtd", "rtd vs mlm: BERT-mini, seq 128, batch 1024"),
            "nsp": lambda: self.pair("nsp", "NSP segment pairs (padded) vs packed MLM: BERT-base, seq 128, batch 128"),
            "fp8": self.fp8,
            "varlen": self.varlen,
            "graphs": self.graphs,
            "local": self.local,
            "demo": self.demo,
            "eval": self.eval,
            "finetune": self.finetune,
            "ablate": self.ablate,
        }
        out = []
        for stage in STAGES:
            try:
                what, result = readers[stage]()
            except Exception as err:  # noqa: BLE001 - a file of another shape than this report reads: said in its line
                what, result = "", f"{stage}.json not readable here ({type(err).__name__}: {err})"
            if stage in self.unreadable:
                result = self.unreadable[stage]
            elif eager := fallbacks(_get(self.data[stage], "rows") or []):
                result += f"; **not all compiled**: {eager}"
            out.append((stage, what, result))
        return out

    def details(self, format_table) -> list[str]:
        """The per-run tables under the summary: trainer_vs_hf.py's stages, then the model step's variants."""
        out = []
        for stage in ("base128", "base128c", "base512", "rtd", "nsp", "fp8"):
            d = self.data[stage]
            if d and d.get("rows"):
                out += ["", f"### {stage}", "", f"`{d['meta']['command']}`", ""]
                out.append(format_table(d["meta"], d["rows"]))
        step = self.data["step"]
        if step:
            out += ["", "### step", "", f"`{step['meta']['command']}`", ""]
            out += ["| variant | batch | step (ms) | tokens/s | TFLOP/s | MFU |", "|---|---|---:|---:|---:|---:|"]
            for r in step["rows"]:
                if "error" in r:
                    out.append(f"| {r['shape']} {r['variant']} | {r['batch']} | failed: {r['error']} | | | |")
                    continue
                mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
                out.append(
                    f"| {r['shape']} {r['variant']} | {r['batch']} | {1000 * r['step_s']:.1f} "
                    f"| {_rate(r['tokens_s'])} | {r['tflops']:.3g} | {mfu} |"
                )
        return out


def report(res: Path) -> str:
    spec = importlib.util.spec_from_file_location("trainer_vs_hf", ROOT / "benchmarks" / "trainer_vs_hf.py")
    tvh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tvh)
    r = Report(res)
    ran = [s for s in STAGES if r.stages[s]]
    if not ran:
        return f"no stage has written to {res} yet"
    tiny = any(r.stages[s].get("tiny") for s in ran)
    # stages collected from several calls may have run on different cards (a call may get an H200 for an H100), or
    # of other code: a stage file that does not say counts as unknown, so an older call's results are not passed off
    devices = sorted({r.stages[s].get("device", "device not recorded") for s in ran})
    commits = sorted({r.stages[s].get("commit", "commit not recorded") for s in ran})
    device = next((d["meta"]["device"] for d in r.data.values() if "device" in (_get(d, "meta") or {})), "?")
    if len(devices) > 1:
        device = f"{len(devices)} devices ({'; '.join(devices)}): compare figures of one device only"
    out = [
        f"## GPU suite: {device}"
        + (" (--tiny: a rehearsal at tiny shapes; no figure here measures anything)" if tiny else "")
    ]
    if len(commits) > 1:
        out += ["", f"**Stages of {len(commits)} commits** ({'; '.join(commits)}): compare figures of one commit only"]
    elif commits != ["commit not recorded"]:
        out += ["", f"Commit {commits[0]}."]
    out += ["", "| stage | measurement | result | exit, seconds |", "|---|---|---|---|"]
    for stage, what, result in r.lines(tvh.fallbacks):
        st = r.stages[stage]
        done = f"{st['rc']}, {st['seconds']:.0f}" if st else "not run"
        if st and len(devices) > 1:
            done += f", {st.get('device', 'device not recorded')}"
        if st and len(commits) > 1:
            done += f", {st.get('commit', 'commit not recorded')}"
        if not st:
            result = "-"
        elif st.get("skipped"):
            result, done = f"**skipped**: {st['skipped']}", "-"
        elif st["rc"] != 0:  # a stage stopped at the deadline or failed: what it wrote before (after every repeat)
            why = "stopped at the deadline" if st.get("deadline") else "failed"
            result = f"**{why}** (see {stage}.log)" + (f"; what it wrote: {result}" if r.data.get(stage) else "")
        out.append(f"| {stage} | {what} | {result} | {done} |")
    try:
        out += r.details(tvh.format_table)
    except Exception as err:  # noqa: BLE001 - the summary above stands without them
        out += ["", f"(the per-run tables could not be written: {type(err).__name__}: {err})"]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("report")
    r.add_argument("results", type=Path)
    d = sub.add_parser("demo-summary")
    d.add_argument("--run", type=Path, required=True)
    d.add_argument("--heldout", type=Path, required=True)
    d.add_argument("--seconds", type=float, required=True)
    d.add_argument("--max-samples", type=int, default=0)
    d.add_argument("--json", type=Path, required=True)
    g = sub.add_parser("ablation-progress")
    g.add_argument("config")
    g.add_argument("overrides", nargs="*")
    g.add_argument("--before", type=Path)
    g.add_argument("--json", type=Path, required=True)
    s = sub.add_parser("add-seconds")
    s.add_argument("file", type=Path)
    s.add_argument("seconds", type=float)
    a = p.parse_args()
    if a.what == "report":
        print(report(a.results))
    elif a.what == "ablation-progress":
        a.json.write_text(json.dumps(ablation_progress(a.config, a.overrides, a.before), indent=1))
    elif a.what == "demo-summary":
        summary = demo_summary(a.run, a.heldout, a.seconds, a.max_samples)
        a.json.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
    else:
        data = json.loads(a.file.read_text())
        data["seconds"] = a.seconds
        a.file.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
