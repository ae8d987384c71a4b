"""Pluggable pretraining objectives. Each module registers itself; imports are explicit, never by scan."""

from objectives.base import (IGNORE_INDEX, REGISTRY, Objective, ObjectiveOptions, ObjectiveOutput, SpecialTokens,
                             build_objectives, register, sample_builder_for, validate_objectives)
from objectives import mlm  # noqa: F401  (registers "mlm")

__all__ = ["IGNORE_INDEX", "REGISTRY", "Objective", "ObjectiveOptions", "ObjectiveOutput", "SpecialTokens",
           "build_objectives", "register", "sample_builder_for", "validate_objectives"]
