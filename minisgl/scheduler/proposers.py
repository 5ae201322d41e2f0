"""The speculative proposers by name (`--speculative NAME`): each a `Proposer` (scheduler/speculative.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.registry import Registry

from .draft import DraftProposer
from .speculative import NgramProposer, Proposer

if TYPE_CHECKING:
    from minisgl.engine import Engine

    from .config import SchedulerConfig

PROPOSERS: Registry[type[Proposer]] = Registry("speculative method")
PROPOSERS.register("ngram")(NgramProposer)
PROPOSERS.register("draft")(DraftProposer)


def create_proposer(config: SchedulerConfig, target: Engine) -> Proposer | None:
    """The proposer `config.speculative` names, next to the target's engine; None when speculation is off."""
    if config.speculative is None:
        return None
    return PROPOSERS.get(config.speculative).create(config, target)
