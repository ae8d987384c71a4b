"""The HF architectures this project exports and imports, one module per architecture (family), registered
explicitly here (never by directory scan). See `base` for the record and how to add one."""

from pretrain.hf.architectures import albert, bert, electra, modernbert  # noqa: F401  (registration)
from pretrain.hf.architectures.base import (
    REGISTRY,
    Architecture,
    Card,
    Link,
    Part,
    Table,
    Target,
    get,
    names,
    register,
    select_architecture,
    unregister,
)

__all__ = [
    "REGISTRY",
    "Architecture",
    "Card",
    "Link",
    "Part",
    "Table",
    "Target",
    "get",
    "names",
    "register",
    "select_architecture",
    "unregister",
]
