"""Pluggable pretraining objectives. Each module registers itself; imports are explicit, never by scan: this
package's below, then the modules named in $PRETRAIN_PLUGINS (objectives kept outside the package)."""

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
    Range,
    build_objectives,
    check_scheduled_options,
    import_plugins,
    option,
    pair_objectives,
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
    "Range",
    "build_objectives",
    "check_scheduled_options",
    "option",
    "pair_objectives",
    "register",
    "sample_builder_for",
    "validate_objectives",
]

import_plugins()  # last: a plugin imports this package, complete by now
