"""When a run stops: max_steps, max_minutes, exit_after_steps, a signal, or too many non-finite steps (the
`StopReason` it records, with the exit code).

Every rank takes the same decision: the flags are OR-ed over ranks in one small CPU all-reduce per step (gloo, never
the GPU). Non-finite steps are known on the device (the optimizer's skip flags) and read at log steps and before a
checkpoint, so `nan_policy` acts at the next log step at the latest.
"""

from __future__ import annotations

import signal
import time

from pretrain.train.state import StopReason, TrainState

EXIT_PREEMPTED = 75  # SIGTERM: the step finished, a checkpoint was written; run the same command to resume
EXIT_NONFINITE = 76  # stopped by train.nan_policy: the last good checkpoint is the latest


class StopFlag:
    """Set by SIGTERM/SIGINT while entered; the step in progress finishes, then we checkpoint and exit. Entered
    as soon as the run directory is ours, so a signal during set-up also ends in a checkpoint and exit 75."""

    def __init__(self):
        self.signal = 0
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        self.restore()

    def _handle(self, signum, frame):
        self.signal = signum

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Stopping:
    """The stop rules of one invocation: `requested` after every step (the caller ORs it over ranks), then `stop`
    to record why; `count_skips` with the skip flags read at log steps and before a checkpoint. The skip counters
    live in the run's `TrainState`, so every checkpoint saves them as they are."""

    def __init__(self, train_cfg, state: TrainState, flag: StopFlag):
        self.t = train_cfg
        self.state = state
        self.start_step = state.step
        self.started = time.time()
        self.flag = flag
        self.reason, self.exit_code = StopReason.MAX_STEPS, 0

    def timed_out(self) -> bool:
        return self.t.max_minutes > 0 and (time.time() - self.started) / 60 >= self.t.max_minutes

    def requested(self, step: int) -> tuple[bool, bool, bool]:
        """This rank's reasons to stop after `step`: (a signal, the clock, exit_after_steps). The caller ORs each
        over ranks (`any_rank`) and gives the result to `stop`, so every rank records the same reason."""
        return (
            bool(self.flag.signal),
            self.timed_out(),
            self.t.exit_after_steps > 0 and step - self.start_step >= self.t.exit_after_steps,
        )

    def stop(self, signalled: bool, timed_out: bool) -> None:
        """Record why the run stops now, from the reasons OR-ed over ranks: a rank whose clock started later (rank 0
        sets up the loggers first) must not call another rank's max_minutes an exit_after_steps, which `pretrain
        run` does not export."""
        if signalled:
            self.reason = StopReason.SIGNAL
        else:
            self.reason = StopReason.MAX_MINUTES if timed_out else StopReason.EXIT_AFTER_STEPS
        self.exit_code = EXIT_PREEMPTED if signalled else 0

    def count_skips(self, flags: list[bool]) -> tuple[int, bool]:
        """Fold the skip flags of the steps since the last call (oldest first) into the state; returns (newly
        skipped, whether `nan_policy` says stop)."""
        stop = False
        for skipped in flags:
            self.state.skipped_in_a_row = self.state.skipped_in_a_row + 1 if skipped else 0
            stop |= skipped and (self.t.nan_policy == "stop" or self.state.skipped_in_a_row >= self.t.max_skipped_steps)
        new = sum(flags)
        self.state.skipped_steps += new
        if stop:
            self.reason, self.exit_code = StopReason.NONFINITE, EXIT_NONFINITE
        return new, stop
