"""Which checkpoints may be averaged into one model (`pretrain average`): each once (not named twice, nor as a
linked or copied duplicate), of one tokenizer and architecture, from one initialisation, on one side of a RoPE theta
change."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.core.errors import UserError
from pretrain.train.fingerprint import differences
from pretrain.train.setup import checkpoint_config
from pretrain.train.state import TrainState


def check_averageable(given: list[Path], paths: list[Path]) -> None:
    """A UserError naming what keeps `paths` (the checkpoints `given` resolve to) from being averaged."""
    _refuse_repeats(given, paths)
    _refuse_other_models(paths)


def _refuse_repeats(given: list[Path], paths: list[Path]) -> None:
    """A checkpoint named twice (as itself, as the latest of a run also named, as a decay branch's hard-linked copy of
    it, or as a copy: the same weights under another path, by inode or by the sha256 its integrity.json records)
    would weigh twice in the mean."""
    seen: dict[object, Path] = {}
    for name, path in zip(given, paths):
        stats = [f.stat() for f in path.rglob("*") if f.is_file()]
        files: set[object] = {(st.st_dev, st.st_ino) for st in stats} | _weight_hashes(path)
        again = next((seen[f] for f in files if f in seen), None)
        if again is not None:
            raise UserError(
                f"{name} and {again} are the same checkpoint ({path.resolve()}: the same files): each checkpoint is "
                "averaged once; name it once"
            )
        seen.update(dict.fromkeys(files, Path(name)))


def _weight_hashes(path: Path) -> set[str]:
    """The sha256 of a checkpoint's model states (DeepSpeed's mp_rank_* files), as its integrity.json records them."""
    from pretrain.train.checkpoint import INTEGRITY

    try:
        record = json.loads((path / INTEGRITY).read_text())
        return {str(v["sha256"]) for k, v in record.items() if Path(k).name.startswith("mp_rank_")}
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return set()  # (verified where it is loaded, which names a damaged record)


def _refuse_other_models(paths: list[Path]) -> None:
    """Checkpoints whose tokenizer or model settings differ from the first's (by the fingerprints they recorded) are
    not averaged: two vocabularies of one size gave a mean of unrelated embeddings under the first's tokenizer."""

    def model_keys(path: Path) -> dict:
        record = TrainState.load(path).fingerprint or {}
        return {k: v for k, v in record.items() if k.startswith(("tokenizer", "model."))}

    first = model_keys(paths[0])
    for path in paths[1:]:
        diffs = differences(first, model_keys(path))
        if diffs:
            key, a, b = diffs[0]
            raise UserError(
                f"{path} is not a checkpoint of the model {paths[0]} is: {key} is {b} there, {a} here; only "
                f"checkpoints of one model (one tokenizer, one architecture) are averaged"
            )
    _refuse_other_inits(paths)
    _refuse_other_positions(paths)


def _refuse_other_inits(paths: list[Path]) -> None:
    """Checkpoints of runs initialised apart (another model.init_from, or none and another train.seed): their weights
    are not aligned unit for unit, and their mean is no model (averaging needs one starting point: a run's
    checkpoints, its decay branches, fine-tunings of one init_from). A run from init_from and one from scratch were
    let through where their seeds matched (1234, every run's default)."""

    starts = [_start(p) for p in paths]
    for path, here in zip(paths[1:], starts[1:]):
        if here != starts[0]:
            raise UserError(
                f"{path} and {paths[0]} were initialised apart ({' '.join(here)} there, {' '.join(starts[0])} here): "
                "the mean of two models initialised apart is not a model; average the checkpoints of one run (and its "
                "decay branches, or runs continued from its exports)"
            )


def _start(path: Path, depth: int = 0) -> tuple[str, str]:
    """Where the weights of checkpoint `path` started: its train.seed, or its model.init_from; an init_from that is an
    export (or a checkpoint) of a run of ours goes back to that run's own start (a run continued from another's
    export shares its initialisation)."""
    from pretrain.core.outputs import enclosing_run
    from pretrain.train.checkpoint import latest_checkpoint

    cfg = checkpoint_config(path)[0]
    init = Path(cfg.model.init_from).resolve() if cfg.model.init_from else None
    if init is None:
        return ("train.seed", str(cfg.train.seed))
    run = enclosing_run(init)
    if run is not None and depth < 8:
        try:
            latest = latest_checkpoint(run / "checkpoints")
        except UserError:
            latest = None
        if latest is not None:
            return _start(latest, depth + 1)
    return ("model.init_from", str(init))


def _refuse_other_positions(paths: list[Path]) -> None:
    """Checkpoints of one RoPE run on either side of a schedule phase that changed rope_theta (a context extension):
    the fingerprint records the run's base theta only, and the average was exported under the last one's, though the
    others' weights were trained to read positions under another."""
    models = [checkpoint_config(p)[0].model for p in paths]
    if models[0].position_embedding != "rope":
        return
    for path, model in zip(paths[1:], models[1:]):
        if model.rope_theta != models[0].rope_theta:
            raise UserError(
                f"{path} trained its last step under model.rope_theta {model.rope_theta:g}, {paths[0]} under "
                f"{models[0].rope_theta:g} (a schedule phase changed it): RoPE positions mean something else under "
                "each, so their weights are not averaged; average checkpoints of one phase"
            )
