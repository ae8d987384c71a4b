"""What a run keeps fixed across resumes, and the check that refuses a resume which would change it.

Every checkpoint records the run's fingerprint: the tokenizer and the data it trained on, the model's shape, the
objectives and their options, what a sample is (sequence length, packing), the global batch, the seed, and what the
optimizer state's layout depends on (precision, ZeRO stage, optimizer, loss normalization). Resuming with any of them
changed would pair the checkpoint's weights and sample order with something they were not trained for, or fail deep
inside DeepSpeed; `check_resume` refuses before anything is written, naming each difference, unless
`train.allow_changes` lists it. Everything else may change on resume (see the README's "Resuming"), and
`changed_settings` says what did.

A schedule (`schedule:`) is compared by what it does rather than by its text: a change that alters no step the
checkpoint has trained (a later phase, a ramp's end) is allowed, a change to a trained step is refused, naming it
(`pretrain.core.schedule.first_change`).
"""

from __future__ import annotations

from typing import Any

from pretrain.core.config import GLOBAL_BATCH, ModelConfig, RunConfig, ScheduleConfig
from pretrain.core.errors import UserError
from pretrain.core.parsing import to_dict
from pretrain.core.schedule import Schedule, first_change

# Model fields that change neither the weights' shapes nor their meaning: free to change on resume.
MODEL_EXECUTION = (
    "hidden_dropout",
    "attention_dropout",
    "initializer_range",
    "unpadded",
    "compile",
    "compile_mode",
    "activation_checkpointing",
    "init_from",
)
FIXED_TRAIN = ("seed", "optimizer", "zero_stage", "loss_normalization")
FIXED_DATA = ("max_seq_len", "packing")
# What the run's own tokenizer was trained with: it is never retrained on resume, so a change would be recorded in
# config.yaml and the model card while the old tokenizer goes on being used. Compared only where both sides record
# them: checkpoints before these keys existed, and runs given a ready tokenizer (data.tokenizer, whose hash is
# compared), have none.
TOKENIZER_SETTINGS = ("tokenizer_type", "vocab_size", "lowercase", "strip_accents", "min_frequency")
DATA_KEY = "data (content of the shards)"
TOKENIZER_KEY = "tokenizer (sha256 of tokenizer.json)"
SCHEDULE_KEY = "schedule"
GLOBAL_BATCH_KEY = "train.global_batch (micro_batch_size x grad_accum_steps x ranks)"
_RECORDED_LATER = {f"data.{k}" for k in TOKENIZER_SETTINGS}


def _flat(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flat(f"{prefix}.{key}", sub))
        return out or {prefix: {}}
    return {prefix: value}


def fingerprint(
    cfg: RunConfig,
    model: ModelConfig,
    precision: str,
    world_size: int,
    tokenizer_sha256: str | None,
    data_sha256: str | None,
) -> dict[str, Any]:
    """The fixed settings of a run, as flat dotted keys. `model` is the resolved model config (vocabulary from the
    tokenizer), `precision` the run's precision mode (`ResolvedRun.precision`: auto resolved on this machine)."""
    t = cfg.train
    record: dict[str, Any] = {
        TOKENIZER_KEY: tokenizer_sha256,
        DATA_KEY: data_sha256,
        **{f"model.{k}": v for k, v in to_dict(model).items() if k not in MODEL_EXECUTION},
        **_flat("objectives", to_dict(cfg.objectives)),
        **{f"data.{k}": getattr(cfg.data, k) for k in FIXED_DATA},
        **({} if cfg.data.tokenizer else {f"data.{k}": getattr(cfg.data, k) for k in TOKENIZER_SETTINGS}),
        # a scheduled global batch is compared step by step with the schedule (None: not compared here)
        GLOBAL_BATCH_KEY: (
            None if any(v.key == GLOBAL_BATCH for v in cfg.schedule.values) else t.global_batch(world_size)
        ),
        "train.precision": precision,
        **{f"train.{k}": getattr(t, k) for k in FIXED_TRAIN},
    }
    if cfg.schedule.active:  # an unscheduled run's record is what it always was
        record[SCHEDULE_KEY] = Schedule.of(cfg).record()
    return record


def _field_defaults() -> dict[str, Any]:
    """'model.x' -> the default of ModelConfig's field x: the value a setting added later had, implicitly, in every
    checkpoint written before it existed (new options default to the old behaviour)."""
    import dataclasses

    return {
        f"model.{f.name}": f.default
        for f in dataclasses.fields(ModelConfig)
        if f.default is not dataclasses.MISSING and f.name not in MODEL_EXECUTION
    }


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, in the checkpoint, now) for each fixed setting that differs. A value the checkpoint did not record
    (None: an older checkpoint) is not compared, nor a model option added since that is at its default."""
    missing = object()
    defaults = _field_defaults()
    diffs = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key, missing), current.get(key, missing)
        if old is None or new is None or old == new or (key in _RECORDED_LATER and missing in (old, new)):
            continue
        if old is missing and key in defaults and new == defaults[key]:
            continue
        diffs.append((key, "absent" if old is missing else old, "absent" if new is missing else new))
    return diffs


def change_allowed(key: str, allow: list[str]) -> bool:
    name = key.split(" ", 1)[0]  # "tokenizer (sha256 ...)" -> "tokenizer"
    return any(name == a or name.startswith(a + ".") for a in allow)


def _show(value: Any) -> str:
    text = str(value)
    return text[:12] + "..." if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text


def schedule_change(
    saved: dict[str, Any], current: dict[str, Any], step: int, world: int, new_world: int | None = None
) -> tuple | None:
    """(key, in the checkpoint, now) when the schedule trains one of the `step` steps done differently, else None.
    `world`: the checkpoint's ranks, `new_world` this launch's. A side without a schedule is the other side's
    settings held constant, at its own recorded global batch."""
    old, new = saved.get(SCHEDULE_KEY), current.get(SCHEDULE_KEY)
    if old is None and new is None:
        return None
    old_schedule = Schedule.from_record(old or _unscheduled(saved, new))
    new_schedule = Schedule.from_record(new or _unscheduled(current, old))
    worlds = (world, world if new_world is None else new_world)
    change = first_change(old_schedule, new_schedule, step, *worlds)
    if change is None:
        return None
    at, what = change
    before, after = (s.series(what, [at], w) for s, w in zip((old_schedule, new_schedule), worlds))
    return (
        f"{SCHEDULE_KEY} (its {what} at step {at}, which the checkpoint has trained)",
        _number(before[0]),
        _number(after[0]),
    )


def _unscheduled(own: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The schedule record of a run without one, from its own fingerprint `own`: its sequence length, RoPE theta and
    objective rates held constant, and the global batch it recorded (exactly, whatever the ranks). `other` (the
    scheduled side's record) fills what an older fingerprint lacks and the batch split, which is not compared."""
    base = dict(other["base"])
    for key, name in (("max_seq_len", "data.max_seq_len"), ("rope_theta", "model.rope_theta")):
        if own.get(name) is not None:
            base[key] = own[name]
    rates = {k: float(v) for k, v in own.items() if k.startswith("objectives.") and isinstance(v, float)}
    record = {"base": base, "rates": rates, **to_dict(ScheduleConfig())}
    if own.get(GLOBAL_BATCH_KEY):
        record["values"] = [{"key": GLOBAL_BATCH, "points": [[0, own[GLOBAL_BATCH_KEY]]], "multiple_of": 1}]
    return record


def _number(value: Any) -> Any:
    return int(value) if float(value).is_integer() else round(float(value), 6)


def check_resume(
    saved: dict[str, Any],
    current: dict[str, Any],
    allow: list[str],
    checkpoint,
    step: int = 0,
    world: int = 1,
    new_world: int | None = None,
) -> None:
    """Refuse (UserError) to resume `checkpoint` when a fixed setting differs and `allow` does not list it. `step`:
    the checkpoint's step, `world` its ranks, `new_world` this launch's (a schedule may change after that step, not
    before)."""
    change = schedule_change(saved, current, step, world, new_world)
    saved, current = ({k: v for k, v in d.items() if k != SCHEDULE_KEY} for d in (saved, current))
    diffs = [d for d in differences(saved, current) if not change_allowed(d[0], allow)]
    if change is not None and not change_allowed(SCHEDULE_KEY, allow):
        diffs.append(change)
    if not diffs:
        return
    lines = "; ".join(f"{key}: {_show(old)} in the checkpoint, {_show(new)} now" for key, old, new in diffs)
    keys = sorted({key.split(" ", 1)[0] for key, _, _ in diffs})
    raise UserError(
        f"cannot resume {checkpoint} with changed settings ({lines}). The run directory was left as it "
        "was. Use the settings it was started with, or another run name; to continue on purpose anyway, "
        f"add train.allow_changes=[{','.join(keys)}]"
    )


def changed_settings(saved_config: dict, current_config: dict) -> list[str]:
    """'key: old -> new' for every setting that differs between two resolved configs (as dicts)."""
    old, new = _flat("", saved_config), _flat("", current_config)
    return [
        f"{k[1:]}: {old.get(k)} -> {new.get(k)}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and k[1:] not in ("name", "output_dir", "train.allow_changes")
    ]
