"""An ablation's runs one at a time against `launch.jobs` at a time, side by side on the same machine.

The peer is our own `pretrain ablate` with launch.jobs=1, what a user runs without the option. The data (tokenizer,
shards) is built once, by a first invocation that is not timed, and copied into each timed ablation directory, so
that both sides time their runs alone: pretraining, export, fine-tunings and probes, each run in its processes.
Repeats alternate the two sides (the order swapped every other repeat); the medians and their ratio are printed.
On a GPU this says whether runs sharing it finish sooner than one after another; on a CPU of few cores, where each
run already uses them all, it shows what the extra processes cost.

    python benchmarks/ablate_side_by_side.py CONFIG [key=value ...] [--jobs 2] [--repeats 3] [--json FILE]

e.g. on the repository's tiny ablation (about a minute per repeat on 2 CPU cores):

    python benchmarks/ablate_side_by_side.py configs/ablation-tiny.yaml launch.threads=1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pretrain.train.distributed import has_cuda, single_process_env  # noqa: E402

DATA = ("tokenizer", "shards", ".bert-pretrain.json")  # what the untimed first invocation leaves for the others


def ablate(config: str, overrides: list[str], out: Path, jobs: int) -> float:
    """Wall seconds of one `pretrain ablate` into `out` at launch.jobs=`jobs` (its exit status checked)."""
    env = single_process_env(WANDB_MODE="disabled")
    if not has_cuda():
        env["DS_ACCELERATOR"] = "cpu"
    command = [sys.executable, "-m", "pretrain.cli", "ablate", config, *overrides, f"output_dir={out}"]
    started = time.perf_counter()
    proc = subprocess.run([*command, f"launch.jobs={jobs}"], env=env, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"`{' '.join(command)} launch.jobs={jobs}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="an ablation config (its output_dir is replaced by a temporary one)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time on the side-by-side side (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="alternated repeats of each side; medians shown")
    parser.add_argument("--json", help="write the timings here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ablate-side-by-side-") as tmp:
        first = Path(tmp) / "data"
        print(f"building the data once (untimed): {first}", flush=True)
        ablate(args.config, args.overrides, first, 1)
        times: dict[int, list[float]] = {1: [], args.jobs: []}
        for repeat in range(args.repeats):
            for jobs in (1, args.jobs) if repeat % 2 == 0 else (args.jobs, 1):
                out = Path(tmp) / f"r{repeat}-j{jobs}"
                out.mkdir()
                for name in DATA:
                    copy = shutil.copytree if (first / name).is_dir() else shutil.copy2
                    copy(first / name, out / name)
                times[jobs].append(ablate(args.config, args.overrides, out, jobs))
                print(f"repeat {repeat + 1}/{args.repeats}, launch.jobs={jobs}: {times[jobs][-1]:.1f} s", flush=True)
                shutil.rmtree(out)
    alone, side = statistics.median(times[1]), statistics.median(times[args.jobs])
    device = "cuda" if has_cuda() else "cpu"
    print(
        f"\n| launch.jobs | median wall (s) | repeats |\n|---|---:|---:|\n| 1 | {alone:.1f} | {args.repeats} |\n"
        f"| {args.jobs} | {side:.1f} | {args.repeats} |\n\nside by side / one at a time: {side / alone:.2f}x the time "
        f"({device}; the runs' pretraining, export, fine-tunings and probes; the data built once, untimed)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "times": times, "ratio": side / alone}, indent=1))


if __name__ == "__main__":
    main()
