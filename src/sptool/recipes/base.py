"""What every recipe module shares: the :class:`Recipe` base class (config + session + plan)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from sptool.run.steps import Step, StepContext, StepFunction

if TYPE_CHECKING:
    from sptool.run.run_dir import RunDir
    from sptool.run.session import Session


def is_parsed(record: dict) -> bool:
    """The generation parsed into a question (``challenge`` did not mark it ``valid: false``)."""
    return record.get("valid") is not False


def has_samples(record: dict) -> bool:
    return bool(record.get("samples"))


class Recipe:
    """A paper's loop: ``plan(iteration)`` lists the iteration's steps, in order.

    ``self.c`` is the recipe's own section of the configuration (``config[name]``), ``self.session``
    the loaded models and the common step functions (solve, verify, train).
    """

    name = ""

    def __init__(self, config: dict, session: "Session"):
        self.config = config
        self.session = session
        self.c = SimpleNamespace(**config[self.name])

    def plan(self, iteration: int) -> list[Step]:
        raise NotImplementedError

    def restore(self, run_dir: "RunDir") -> None:
        """Recover the recipe's own state (WIST's tree) from a run directory; most have none."""

    def filter(self, **options) -> StepFunction:
        """The recipe's filter: verified records -> training groups with rewards and advantages."""
        def filter(ctx: StepContext, records: list[dict]) -> list[dict]:
            from sptool.filter import FilterOptions, FilterStage

            advantage = "dr_grpo" if self.config["train"]["loss"] == "dr_grpo" else "grpo"
            stage = FilterStage(self.name, FilterOptions(advantage=advantage, seed=ctx.seed, **options))
            return ctx.run_stage(stage, records)
        return filter
