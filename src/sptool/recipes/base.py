"""What every recipe module shares: the :class:`Recipe` base class (config + session + plan)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from sptool.recipes.config import section_object
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

    ``self.c`` is the recipe's own section of the configuration (a ``Config`` instance), ``self.session``
    the loaded models and the common step functions (solve, verify, train).
    """

    name = ""
    Config: type = object                 # the recipe section's dataclass
    prelude_name = ""                     # what iteration 0 is, when the recipe has one (progress)

    def __init__(self, config: dict, session: "Session"):
        self.config = config
        self.session = session
        self.settings = session.settings    # the shared sections, typed
        self.c = section_object(self.Config, config[self.name])

    def plan(self, iteration: int) -> list[Step]:
        raise NotImplementedError

    def prelude(self) -> list[Step]:
        """Steps run once before the first iteration, as iteration 0 (``iter-0000``); most
        recipes have none."""
        return []

    def restore(self, run_dir: "RunDir") -> None:
        """Recover the recipe's own state (WIST's tree) from a run directory; most have none."""

    def filter(self, **inputs: str) -> StepFunction:
        """The recipe's filter (``sptool.filter.FILTERS``): verified records -> training groups.
        Its settings are the recipe section's fields of the same names; ``inputs`` hands it the
        output of other steps by keyword."""
        def filter(ctx: StepContext, records: list[dict]) -> list[dict]:
            from sptool.filter import FILTERS

            filter_class = FILTERS.get(self.name)
            extra = {name: ctx.output(step) for name, step in inputs.items()}
            stage = filter_class(self.filter_options(filter_class.Options), advantage=self.advantage,
                                 seed=ctx.seed, **extra)
            return ctx.run_stage(stage, records)
        return filter

    @property
    def advantage(self) -> str:
        """The group advantage of the trainer's objective (``train.loss``)."""
        from sptool.train.losses import OBJECTIVES

        return OBJECTIVES.get(self.settings.train.loss).advantage

    def filter_options(self, options: type):
        """The filter's options from the recipe section (fields of the same names)."""
        return options(**{f.name: getattr(self.c, f.name) for f in fields(options)})
