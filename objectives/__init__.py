"""Pluggable pretraining objectives. Each module registers itself; imports are explicit, never by scan."""

from objectives.base import (IGNORE_INDEX, REGISTRY, Objective, ObjectiveOptions, ObjectiveOutput, SpecialTokens,
                             build_objectives, register, sample_builder_for, validate_objectives)
from objectives import mlm  # noqa: F401  (registers "mlm")
from objectives import rtd  # noqa: F401
from objectives import span  # noqa: F401
from objectives import nsp, sop  # noqa: F401
from objectives import plm  # noqa: F401

__all__ = ["IGNORE_INDEX", "REGISTRY", "Objective", "ObjectiveOptions", "ObjectiveOutput", "SpecialTokens",
           "build_objectives", "register", "sample_builder_for", "validate_objectives"]
