"""Which checkpoints may be averaged into one model (`pretrain average`): each once (not named twice, nor as a
hard-linked copy), of one tokenizer and architecture, from one initialisation, on one side of a RoPE theta change."""

from __future__ import annotations

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
    """A checkpoint named twice (as itself, as the latest of a run also named, or as a decay branch's hard-linked copy
    of it: the same files under another path) would weigh twice in the mean."""
    seen: dict[tuple[int, int], Path] = {}
    for name, path in zip(given, paths):
        stats = [f.stat() for f in path.rglob("*") if f.is_file()]
        files = {(st.st_dev, st.st_ino) for st in stats}
        again = next((seen[f] for f in files if f in seen), None)
        if again is not None:
            raise UserError(
                f"{name} and {again} are the same checkpoint ({path.resolve()}: the same files): each checkpoint is "
                "averaged once; name it once"
            )
        seen.update(dict.fromkeys(files, Path(name)))


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
    """Checkpoints of runs initialised apart (other train.seed, no model.init_from they share): their weights are not
    aligned unit for unit, and their mean is no model (averaging needs one starting point: a run's checkpoints, its
    decay branches, fine-tunings of one init_from)."""
    starts = [(c.train.seed, c.model.init_from) for c in (checkpoint_config(p)[0] for p in paths)]
    for path, (seed, init) in zip(paths[1:], starts[1:]):
        if seed != starts[0][0] and not (init and init == starts[0][1]):
            raise UserError(
                f"{path} and {paths[0]} were initialised apart (train.seed {seed} there, {starts[0][0]} here, and no "
                "model.init_from in common): the mean of two independently initialised models is not a model; "
                "average the checkpoints of one run (and its decay branches)"
            )


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
