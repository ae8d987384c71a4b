"""Typed configs of fine-tuning and ablations: frozen dataclasses parsed by `pretrain.core.parsing.from_dict`.

One declaration per option and default: `pretrain finetune`'s options read theirs from `FinetuneConfig`, an
ablation's `eval:` block is an `EvalConfig`, and the whole ablation file an `AblationConfig`. Unknown keys and wrong
types fail naming the file, the key path and the nearest valid key. No torch here: the command line's parser reads
these defaults and must stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from pretrain.core.errors import ConfigError
from pretrain.core.parsing import doc, nearest

MODES = ("probe", "full")
MIN_SEQ_LEN, MIN_PAIR_SEQ_LEN = 3, 5  # [CLS] a [SEP]; [CLS] a [SEP] b [SEP]: a token of each sentence
BUDGET_KINDS = ("tokens", "flops", "time")
MODE_DEFAULTS = {
    "full": {"epochs": 3, "lr": 5e-5, "batch_size": 32},
    "probe": {"epochs": 20, "lr": 1e-2, "batch_size": 64},
}
"""What epochs, lr and batch_size = 0 mean in each mode: BERT's fine-tuning recipe, and a linear head's."""

# Where each task the presets name comes from, for the error when its directory is missing (see data/README.md).
TASK_SOURCES = {
    "mr": "a subset ships in data/tasks/mr; the full set is Sentence Polarity v1.0 (Pang & Lee 2005, CC BY 4.0)",
    "subj": "a subset ships in data/tasks/subj; the full set is Subjectivity v1.0 (Pang & Lee 2004, CC BY 4.0)",
    "cola": "CoLA in-domain (nyu-mll/CoLA-baselines, acceptability_corpus/cola_public/raw) as sentence<TAB>label",
    "rte": "nltk_data's `rte` corpus (PASCAL RTE 1-3) as sentence1<TAB>sentence2<TAB>label",
    "trec": "nltk_data's `qc` corpus (TREC, Li & Roth 2002), coarse labels, as sentence<TAB>label",
    "conll2000": "nltk_data's `conll2000` corpus: its train.txt and test.txt (as dev.txt), CoNLL columns",
}


def _positive(value: float, where: str) -> None:
    if not value > 0:
        raise ConfigError(f"{where}: must be > 0, got {value}")


def _not_negative(cfg: Any, names: tuple[str, ...], where: str) -> None:
    for name in names:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{where}{name}: must be >= 0, got {getattr(cfg, name)}")


@dataclass(frozen=True)
class FinetuneConfig:
    """How one model is fine-tuned (or probed) on one task: `pretrain finetune`'s options."""

    mode: Literal["full", "probe"] = doc(
        "full", "full: fine-tune encoder and head; probe: a linear head on frozen features (what ablations use)."
    )
    epochs: int = doc(0, "Epochs; 0 = the mode's default (3 full, 20 probe).")
    lr: float = doc(0.0, "Peak learning rate; 0 = the mode's default (5e-5 full, 1e-2 probe). Ignored with lrs.")
    batch_size: int = doc(0, "Batch size; 0 = the mode's default (32 full, 64 probe).")
    max_seq_len: int = doc(0, "Truncate inputs to this many tokens; 0 = the model's positions, at most 128.")
    task_type: Literal["auto", "classification", "regression", "token"] = doc(
        "auto", "auto: inferred from the labels (CoNLL columns are token-level)."
    )
    pooling: Literal["mean", "cls"] = doc("mean", "Probe features: the mean of the real tokens, or [CLS].")
    max_train: int = doc(0, "Use a fixed subset of this many training examples (0 = all).")
    random_init: bool = doc(False, "Same config, random weights (a no-pretraining baseline).")
    lrs: list[float] = doc(
        factory=list,
        text="Learning rates to sweep: each is trained on train minus a held-out part and scored there (never on "
        "dev); the best is re-trained on all of train and scored on dev. Empty = lr alone.",
    )
    heldout_fraction: float = doc(0.1, "With lrs: the share of train held out to choose the learning rate.")
    heldout_seed: int = doc(0, "With lrs: the seed of the held-out split (the same split for every model).")
    sweep_seeds: int = doc(1, "With lrs: fine-tuning seeds per learning rate in the sweep (the first of the seeds).")

    def check(self, where: str = "", lrs_key: str = "lrs") -> FinetuneConfig:
        """Ranges; `where` prefixes the keys in messages, `lrs_key` names the list of learning rates there."""
        _not_negative(self, ("epochs", "lr", "batch_size", "max_train", "max_seq_len"), where)
        if 0 < self.max_seq_len < MIN_SEQ_LEN:  # [CLS] [SEP] and no text: scores at chance, with no word
            raise ConfigError(
                f"{where}max_seq_len: {self.max_seq_len} leaves no room for text ([CLS] and [SEP] take 2); give at "
                f"least {MIN_SEQ_LEN} ({MIN_PAIR_SEQ_LEN} for a sentence pair), or 0 for the model's positions"
            )
        for i, lr in enumerate(self.lrs):
            _positive(lr, f"{where}{lrs_key}[{i}]")
        if len(set(self.lrs)) < len(self.lrs):
            raise ConfigError(f"{where}{lrs_key}: {self.lrs} names a learning rate twice")
        if not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"{where}heldout_fraction: must be in (0, 1), got {self.heldout_fraction}")
        _positive(self.sweep_seeds, f"{where}sweep_seeds")
        return self

    def resolved(self) -> FinetuneConfig:
        """epochs, lr and batch_size of 0 replaced by the mode's defaults (`MODE_DEFAULTS`)."""
        defaults = MODE_DEFAULTS[self.mode]
        return replace(self, **{k: getattr(self, k) or v for k, v in defaults.items()})


@dataclass(frozen=True)
class EvalConfig:
    """An ablation's downstream evaluation (`eval:`): every arm and seed on every task, in every mode."""

    tasks: list[str] = doc(factory=list, text="Task directories (TSV or CoNLL), relative to where you run from.")
    seeds: list[int] = doc(factory=lambda: [1, 2, 3], text="Fine-tuning seeds (>= 5 in full mode to report a median).")
    mode: list[str] = doc(factory=lambda: ["probe"], text="probe, full, or both; an ablation probes unless told.")
    pooling: Literal["mean", "cls"] = doc("mean", "Probe features: mean of the real tokens, or [CLS].")
    epochs: int = doc(0, "As FinetuneConfig.epochs.")
    lr: float = doc(0.0, "As FinetuneConfig.lr.")
    batch_size: int = doc(0, "As FinetuneConfig.batch_size.")
    max_seq_len: int = doc(128, "As FinetuneConfig.max_seq_len (0 = the model's positions, at most 128).")
    max_train_examples: int = doc(0, "A fixed subset of each task's train examples (0 = all).")
    lrs: list[float] = doc(
        factory=list, text="As FinetuneConfig.lrs, in full mode: a learning-rate sweep per arm and task."
    )
    probe_lrs: list[float] = doc(factory=list, text="The same for probes (a linear head wants other rates).")
    heldout_fraction: float = doc(0.1, "As FinetuneConfig.heldout_fraction.")
    heldout_seed: int = doc(0, "As FinetuneConfig.heldout_seed.")
    sweep_seeds: int = doc(1, "As FinetuneConfig.sweep_seeds.")

    @property
    def modes(self) -> list[str]:
        return list(self.mode)

    def __getitem__(self, key: str) -> Any:
        """Read as a mapping too (`ab.eval["modes"]`), as the report and its tests' stand-ins do."""
        return getattr(self, key)

    def finetune(self, mode: str) -> FinetuneConfig:
        """The fine-tuning options of one mode."""
        same = {f.name for f in fields(FinetuneConfig)} & {f.name for f in fields(self)} - {"mode", "lrs"}
        return FinetuneConfig(
            mode=mode,
            max_train=self.max_train_examples,
            lrs=list(self.probe_lrs if mode == "probe" else self.lrs),
            **{k: getattr(self, k) for k in same},
        )

    def check(self, where: str = "eval.") -> EvalConfig:
        if not self.mode:
            raise ConfigError(f"{where}mode: '' is not one of {', '.join(MODES)} (or a list of them)")
        for mode in self.mode:
            if mode not in MODES:
                raise ConfigError(
                    f"{where}mode: '{mode}' is not one of {', '.join(MODES)} (or a list of them){nearest(mode, MODES)}"
                )
        if not self.seeds or len(set(self.seeds)) < len(self.seeds):
            raise ConfigError(f"{where}seeds: expected a list of distinct integers, got {self.seeds}")
        for mode in MODES:  # both lists of learning rates, whichever modes run
            self.finetune(mode).check(where, "probe_lrs" if mode == "probe" else "lrs")
        return self


@dataclass(frozen=True)
class BudgetConfig:
    kind: Literal["tokens", "flops", "time"] = doc("flops", "tokens | flops | time (minutes): the same for every arm.")
    amount: float = doc(0.0, "How much of it each arm gets (> 0).")


@dataclass(frozen=True)
class LaunchConfig:
    procs: int = doc(8, "Processes per arm in the commands of --print-commands.")
    scheduler: Literal["single_node", "slurm"] = doc("single_node", "single_node or slurm (--print-commands).")
    threads: int = doc(
        0,
        "Torch threads here and per arm (0 = torch's default, or the host's cores shared out among launch.jobs; 1 "
        "on a shared CPU, where more threads spin-wait).",
    )
    jobs: int = doc(
        1,
        "Runs of `pretrain ablate` at a time, each in a process of its own: on a host with several GPUs, a GPU each "
        "(round robin); on one GPU they share it, which a small encoder's fine-tunings leave mostly idle.",
    )


@dataclass(frozen=True)
class AblationConfig:
    """A `pretrain ablate` config file (see pretrain/evaluation/ablate.py for an example)."""

    output_dir: str = doc("", "The ablation directory (required).")
    run: dict[str, Any] = doc(
        factory=dict, text="The run config every arm shares (encoder, data, seed, optimizer); may have a base:."
    )
    arms: dict[str, Any] = doc(
        factory=dict,
        text="Arm name (letters, digits, _ . + = -) -> overrides of run (objectives replace the shared ones; train "
        "options such as lr may differ); the arm named none is the random-encoder baseline (pretrain: false).",
    )
    seeds: list[int] = doc(factory=list, text="Pretraining seeds: each arm runs once per seed (empty = run's seed).")
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def check(self, where: str) -> AblationConfig:
        if not self.output_dir:
            raise ConfigError(f"{where}: output_dir: the ablation directory is required")
        _positive(self.budget.amount, f"{where}: budget.amount")
        for key in ("jobs", "procs"):
            if getattr(self.launch, key) < 1:
                raise ConfigError(f"{where}: launch.{key}: expected >= 1, got {getattr(self.launch, key)}")
        if self.launch.threads < 0:
            raise ConfigError(f"{where}: launch.threads: expected >= 0, got {self.launch.threads}")
        if not self.arms:
            raise ConfigError(f"{where}: arms: expected a mapping of arm name -> overrides, e.g. arms: {{mlm: {{}}}}")
        if len(set(self.seeds)) < len(self.seeds):
            raise ConfigError(
                f"{where}: seeds: expected a list of distinct integers (pretraining seeds), got {self.seeds}"
            )
        try:
            self.eval.check()
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        return self


def missing_task_hint(task: str) -> str:
    """Where to get a task the presets name, for the error when its directory is missing."""
    source = TASK_SOURCES.get(Path(task).name)
    return f"; '{Path(task).name}' is {source} (see data/README.md)" if source else ""
