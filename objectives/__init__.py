"""Pluggable pretraining objectives. Each module registers itself; imports are explicit, never by scan."""

from objectives import (  # noqa: F401
    mlm,  # noqa: F401  (registers "mlm")
    nsp,
    plm,  # noqa: F401
    rtd,  # noqa: F401
    sop,
    span,  # noqa: F401
)
from objectives.base import (
    REGISTRY,
    Objective,
    ObjectiveOptions,
    ObjectiveOutput,
    build_objectives,
    register,
    sample_builder_for,
    validate_objectives,
)
from pretrain.core.tokens import IGNORE_INDEX, SpecialTokens

__all__ = [
    "IGNORE_INDEX",
    "REGISTRY",
    "Objective",
    "ObjectiveOptions",
    "ObjectiveOutput",
    "SpecialTokens",
    "build_objectives",
    "register",
    "sample_builder_for",
    "validate_objectives",
]
