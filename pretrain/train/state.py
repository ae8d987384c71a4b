"""The trainer's state, saved with every checkpoint as trainer_state.json, and why a run stopped.

`TrainState.save` and `TrainState.load` are the only code that writes or reads trainer_state.json. Loading is
backward compatible: a key an older checkpoint lacks takes its default (`world_size` and `fingerprint` stay None:
each reader knows what their absence meant), and a key this version does not know is kept in `extra` and written
back unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from pretrain.core.errors import UserError
from pretrain.core.files import write_atomic

STATE_FILE = "trainer_state.json"


class StopReason(str, Enum):
    """Why an invocation stopped. String-valued: summaries, logs and metrics keep the strings they always had.
    (`str, Enum` with `__str__`, not 3.11's StrEnum: Python 3.10 is supported.)"""

    MAX_STEPS = "max_steps"
    SIGNAL = "signal"
    MAX_MINUTES = "max_minutes"
    EXIT_AFTER_STEPS = "exit_after_steps"
    NONFINITE = "nonfinite"

    def __str__(self) -> str:
        return self.value


@dataclass
class TrainState:
    """Where a run stands. Counters advance in the trainer (step, samples, tokens, training time) and in
    `pretrain.train.stopping.Stopping` (skipped steps); `world_size` and `fingerprint` are those of the invocation
    that saved it."""

    step: int = 0
    consumed_samples: int = 0  # sequences of the sample stream used so far: where the loader resumes
    tokens_seen: int = 0  # real (non-padding) tokens over all ranks
    elapsed_s: float = 0.0  # training time over all invocations
    skipped_steps: int = 0  # optimizer steps skipped for non-finite gradients, in all
    skipped_in_a_row: int = 0  # ... and in a row up to `step` (train.max_skipped_steps)
    world_size: int | None = None  # None: a checkpoint written before it was recorded
    fingerprint: dict[str, Any] | None = None  # None: a checkpoint written before fingerprints (`fingerprint.py`)
    phase: int | None = None  # with a schedule (`pretrain.core.schedule`), the phase of the last step trained
    phase_start_samples: int | None = None  # ... and consumed_samples when it began: the phase stream's position
    # a log interval a checkpoint cut (a stop, or save_every between log steps): its steps and sums over ranks, which
    # the resumed run goes on from (`Trainer.carry_interval`), so its next line is the one a run never stopped logs
    open_interval: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as they were

    def to_dict(self) -> dict[str, Any]:
        """The JSON record: the known keys in their historical order (None ones left out), then `extra`."""
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**{k: v for k, v in known.items() if v is not None}, **self.extra}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "trainer state") -> TrainState:
        if not isinstance(data, dict):
            raise UserError(f"{where} does not hold a trainer state (a JSON object)")
        names = {f.name for f in fields(cls)} - {"extra"}
        state = cls(**{k: v for k, v in data.items() if k in names})
        state.extra = {k: v for k, v in data.items() if k not in names}
        return state

    def save(self, checkpoint: Path) -> None:
        write_atomic(Path(checkpoint) / STATE_FILE, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, checkpoint: Path) -> TrainState:
        """The state saved in a checkpoint directory (any version of this tool)."""
        path = Path(checkpoint) / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise UserError(f"cannot read {path}: {err}") from None
        return cls.from_dict(data, str(path))
