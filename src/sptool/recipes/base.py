"""What every recipe module shares: the :class:`Recipe` base class (config + session + plan),
the record predicates plans use, and the seeded walk through a data set."""

from __future__ import annotations

import random
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Callable

from sptool.run.config import section_object
from sptool.run.steps import Step, StepContext, StepFunction

if TYPE_CHECKING:
    from sptool.run.run_dir import RunDir
    from sptool.run.session import Session


def marked_valid(record: dict) -> bool:
    """The generation parsed into a question (``challenge`` did not mark it ``valid: false``)."""
    return record.get("valid") is not False


def has_samples(record: dict) -> bool:
    return bool(record.get("samples"))


def walk(items: list, count: int, position: int, seed_of: Callable[[int], int]) -> list:
    """Items ``position·count … (position+1)·count − 1`` of an endless walk through seeded
    permutations of ``items`` (epoch ``e`` shuffled by ``seed_of(e)``): successive positions draw
    successive batches, every item once per epoch, none twice in a batch when ``count <= len``."""
    n = len(items)
    orders: dict[int, list[int]] = {}
    out = []
    for index in range(position * count, (position + 1) * count):
        epoch, offset = divmod(index, n)
        if epoch not in orders:
            orders[epoch] = list(range(n))
            random.Random(seed_of(epoch)).shuffle(orders[epoch])
        out.append(items[orders[epoch][offset]])
    return out


class Recipe:
    """A paper's loop: ``plan(iteration)`` lists the iteration's steps, in order.

    ``self.c`` is the recipe's own section of the configuration (a ``Config`` instance), ``self.session``
    the loaded models and the common step functions (solve, verify, train).
    """

    name = ""
    Config: type = object                 # the recipe section's dataclass
    Filter: Any = None                    # its filter stage (sptool.filter): verified records -> groups
    prompt_roles: tuple[str, ...] = ("solve",)  # the prompt roles it asks a model in ([prompts])
    needs_data = False                    # trains on a labelled problem set (--data)
    prelude_name = ""                     # what iteration 0 is, when the recipe has one (progress)

    def __init__(self, config: dict, session: "Session"):
        self.config = config
        self.session = session
        self.settings = session.settings    # the shared sections, typed
        self.c = section_object(self.Config, config[self.name])

    @classmethod
    def check_section(cls, section) -> None:
        """Checks of the recipe's own section beyond types and ranges, before any work (WIST:
        its endpoints); most recipes have none."""

    def plan(self, iteration: int) -> list[Step]:
        raise NotImplementedError

    def prelude(self) -> list[Step]:
        """Steps run once before the first iteration, as iteration 0 (``iter-0000``); most
        recipes have none."""
        return []

    def restore(self, run_dir: "RunDir") -> None:
        """Recover the recipe's own state (WIST's tree) from a run directory; most have none."""

    def schema(self) -> dict[str, dict[str, Any]]:
        """Every key's default (what a run directory saved before a key existed had)."""
        from sptool.recipes import schema_for

        return schema_for(self.name)

    def config_text(self) -> str:
        """The run's effective configuration as TOML (``config.toml`` of the run directory)."""
        from sptool.recipes import to_toml

        return to_toml(self.config)

    def filter(self, **inputs: str) -> StepFunction:
        """The recipe's filter (its ``Filter``): verified records -> training groups. Its
        settings are the recipe section's fields of the same names; ``inputs`` hands it the
        output of other steps by keyword."""
        def filter(ctx: StepContext, records: list[dict]) -> list[dict]:
            extra = {name: ctx.output(step) for name, step in inputs.items()}
            stage = self.Filter(self.filter_options(self.Filter.Options), advantage=self.advantage,
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
