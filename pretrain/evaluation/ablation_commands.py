"""`pretrain ablate --print-commands`: the commands that run an ablation on a cluster, a job per arm.

Step 1 builds the data the arms share (`data_commands`: the settings of the config spelled out, so that the data is
what `pretrain ablate` itself would build), step 2 launches each arm that is not trained with its resolved config and
its budget's plan (recorded in the arm's state.json, for step 3), step 3 is `pretrain ablate` again: it takes the
trained arms over for export, downstream evaluation and the report.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from pretrain.core.config import save_config
from pretrain.core.files import write_atomic
from pretrain.core.schedule import Schedule
from pretrain.evaluation.ablation_plan import Ablation, apply_budget, measure_phase_flops
from pretrain.evaluation.ablation_record import arm_settings, check_settings, holding, read_state, write_state


def data_commands(ab: Ablation) -> list[str]:
    """`pretrain tokenizer` and `pretrain shards` with every setting of the config that they take, so that they build
    the data `pretrain ablate` would: with the commands' defaults, a cased config got a lowercased tokenizer (its
    min_frequency, text_field, ... the defaults too), which the arms and the report then used as it was. Weighted
    data.sources (a shard directory per source and the mixture's manifest) have no such commands: `pretrain ablate
    --data-only` builds them, as the ablation would."""
    d = ab.base.data
    if d.sources:
        return [f"pretrain ablate {q(ab.out / 'ablation.yaml')} --data-only"]
    corpus = " ".join(q(c) for c in d.corpus)
    reading = (
        f"--text-field {q(d.text_field)} --text-documents {d.text_documents} --on-bad {d.on_bad_document} "
        f"--max-document-bytes {d.max_document_bytes}"
    )
    tokenizer = (
        f"pretrain tokenizer {corpus} --out {q(ab.base.tokenizer_dir)} --type {d.tokenizer_type} "
        f"--vocab-size {d.vocab_size} --min-frequency {d.min_frequency}"
        + ("" if d.lowercase else " --cased")
        + ("" if d.strip_accents else " --keep-accents")
        + (f" --sample-docs {d.tokenizer_sample_docs}" if d.tokenizer_sample_docs else "")
    )
    shards = (
        f"pretrain shards {corpus} --tokenizer {q(ab.base.tokenizer_dir)} --out {q(ab.base.shards_dir)} "
        f"--docs-per-shard {d.docs_per_shard}"
    )
    return [f"{tokenizer} {reading}", f"{shards} {reading}"]


def print_commands(ab: Ablation) -> list[str]:
    """Write each arm's config (budget applied) and return one launch command per arm."""
    with holding(ab):
        return _print_commands(ab)


def _print_commands(ab: Ablation) -> list[str]:
    check_settings(ab)
    procs = ab.launch.procs
    lines = [
        "# 1. data, once (a cache hit when it exists); put the ablation directory on a shared filesystem",
        *data_commands(ab),
        f"# 2. one job per arm ({ab.budget_kind} budget {ab.budget_amount:g}, {procs} "
        f"process{'es' if procs != 1 else ''} each)",
    ]
    have_data = (ab.base.tokenizer_dir / "tokenizer.json").is_file() and (
        ab.base.shards_dir / "manifest.json"
    ).is_file()
    for arm in ab.arms:
        if not arm.pretrain:
            continue
        cfg_path = ab.arm_config_path(arm)
        if read_state(arm).get("trained"):
            lines.append(f"# {arm.name}: already trained here ({arm.cfg.run_dir}), nothing to launch")
            continue
        settings = arm_settings(ab, arm)  # as the ablation file gives it, before the budget below
        phases = len(Schedule.of(arm.cfg).phases)
        if ab.budget_kind == "flops" and not have_data:
            lines.append(f"# {arm.name}: a flops budget needs the data to measure a step; run step 1, then again")
            continue
        # the report's FLOPs whatever the budget; without the data, step 3 measures them (`planned_flops_per_step`)
        plan = apply_budget(ab, arm, measure_phase_flops(arm.cfg) if have_data else [0] * phases, world=procs)
        save_config(arm.cfg, cfg_path)
        # the local `pretrain ablate` of step 3 must find this plan, or it would re-plan for one process
        write_state(arm, {"settings": settings, **read_state(arm), "plan": plan})
        if ab.launch.scheduler == "slurm":  # the plan's ranks: slurm.sbatch's own header asks for one node of 8
            per_node = min(procs, SLURM_GPUS_PER_NODE)
            nodes = -(-procs // per_node)
            lines.append(
                f"sbatch --job-name={q('ablate-' + arm.name)} --nodes={nodes} --ntasks={procs} "
                f"--ntasks-per-node={per_node} --gpus-per-node={per_node} launch/slurm.sbatch {q(cfg_path)}"
            )
        else:
            lines.append(f"launch/single_node.sh {procs} {q(cfg_path)}")
    write_atomic(ab.out / "ablation.yaml", yaml.safe_dump(ab.raw, sort_keys=False))
    lines += [
        "# 3. when the jobs are done: export, downstream evaluation and the report (trained arms are not retrained)",
        f"pretrain ablate {q(ab.out / 'ablation.yaml')}",
    ]
    return lines


SLURM_GPUS_PER_NODE = 8  # launch/slurm.sbatch's header: one node of 8 tasks, a GPU each, unless the command says


def q(path: Path | str) -> str:
    """A path as a shell word: printed commands are pasted into a shell, spaces and all."""
    return shlex.quote(str(path))
