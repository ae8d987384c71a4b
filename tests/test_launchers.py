"""The launch scripts on one machine: real CPU runs, and stand-ins on PATH (`pdsh`, `ssh`, `scontrol`, `srun`,
`torchrun`) that record what a launcher gives them. tests/test_multinode.py runs the launchers across two hosts."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"


# ----------------------------------------------------------------------------------------------
# Bash


def test_launchers_expand_arrays_that_may_be_empty_safely():
    """Under set -u, bash before 4.4 (macOS's 3.2, CentOS 7's 4.2) calls "${a[@]}" of an empty array unbound:
    multi_node.sh failed so without NODE_RANK. Each array expansion takes the ${a[@]+"${a[@]}"} form."""
    for script in [*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch")]:
        text = re.sub(r'\$\{(\w+)\[@\]\+"\$\{\1\[@\]\}"\}', "", script.read_text())
        assert not re.search(r"\$\{\w+\[@\]\}", text), f"{script.name}: an unguarded array expansion"
