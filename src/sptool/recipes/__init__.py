"""Recipes: TOML files with each paper's defaults, merged and validated in one place.

The effective configuration of a run is built as (later wins)::

    defaults (dataclasses)      <  recipes/<name>.toml  <  its [tiny] table (with --tiny)
                                <  --config FILE        <  --set key=value (command line)

Every key is a field of a section dataclass (``recipes/config.py`` for the shared sections, each
recipe module's ``Config`` for its own) with its default, help text, paper section and range. A
key's type is its default's; an unknown key gets a did-you-mean hint and a value of the wrong type
names the key (both :class:`~sptool.core.records.UsageError`, exit 2).
"""

from __future__ import annotations

import copy
import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from sptool.prompts import prompt_spec  # noqa: F401 - its home is sptool.prompts
from sptool.core.records import UsageError
from sptool.core.registry import Registry, closest

# name -> "module:class" of its plan (loaded on use); each module reads like its paper's algorithm
_PLANS = {"wist": "sptool.recipes.wist:Wist", "svs": "sptool.recipes.svs:Svs",
          "rzero": "sptool.recipes.rzero:RZero", "rquest": "sptool.recipes.rzero:RQuest",
          "rlvr": "sptool.recipes.rlvr:Rlvr"}
RECIPES: Registry = Registry("recipe", _PLANS)
RECIPE_NAMES = tuple(_PLANS)  # in the order `recipes list` shows them

def sections_for(recipe: str) -> dict[str, type]:
    """Section name -> its dataclass: the shared sections, then the recipe's own."""
    from sptool.run.config import COMMON_SECTIONS

    return {**COMMON_SECTIONS, recipe: RECIPES.get(recipe).Config}


def prompts_schema(recipe: str) -> dict[str, Any]:
    """The ``[prompts]`` section of ``recipe``: per prompt role it asks a model in (the recipe
    class's ``prompt_roles``), the prompt (a packaged name or a template file), the response prefix
    and the stop strings; an empty prefix or stop list means the prompt's own."""
    from sptool.prompts import ANSWER_ROLES, default_prompt

    section: dict[str, Any] = {}
    for role in RECIPES.get(recipe).prompt_roles:
        section[role] = default_prompt(role)
        section[f"{role}_prefix"] = ""
        section[f"{role}_stop"] = []
        if role in ANSWER_ROLES:  # the optional answer step (see sptool.prompts)
            section.update({f"{role}_answer_prefix": "", f"{role}_answer_stop": [], f"{role}_answer_max_tokens": 0})
    return section


def resolve_prompts(config: dict) -> None:
    """Check every role's prompt and write the prefix and stop strings it uses into the config
    (a packaged prompt's own where the keys are empty), so the run records what it used."""
    from sptool.prompts import ANSWER_ROLES, prompt_spec

    p = config["prompts"]
    for role in RECIPES.get(config["recipe"]).prompt_roles:
        spec = prompt_spec(config, role)
        p[f"{role}_prefix"], p[f"{role}_stop"] = spec.prefix, list(spec.stop)
        if role in ANSWER_ROLES:
            p.update({f"{role}_answer_prefix": spec.answer_prefix, f"{role}_answer_stop": list(spec.answer_stop),
                      f"{role}_answer_max_tokens": spec.answer_max_tokens if spec.answer_prefix else 0})


def schema_for(recipe: str) -> dict[str, dict[str, Any]]:
    """Every key's default (its type is the default's), derived from the section dataclasses."""
    from sptool.run.config import section_defaults

    check_recipe_name(recipe)
    schema = {name: section_defaults(cls) for name, cls in sections_for(recipe).items()}
    schema["prompts"] = prompts_schema(recipe)
    return schema


def check_recipe_name(name: str) -> None:
    RECIPES.check(name)


def make_recipe(config: dict, session):
    """The plan object of ``config['recipe']`` over ``session`` (a :class:`~sptool.run.session.Session`)."""
    return RECIPES.get(config["recipe"])(config, session)


def data_recipes() -> list[str]:
    """The recipes that train on a labelled problem set (``--data``)."""
    return [name for name in RECIPE_NAMES if RECIPES.get(name).needs_data]


def build_run(config: dict, run_dir, *, resume: bool = False, on_event=None, log=None):
    """The :class:`~sptool.run.driver.RunDriver` of ``config``'s recipe in ``run_dir``: its
    session (the run's models), the recipe's plan over it, and the executor."""
    from sptool.run.driver import RunDriver
    from sptool.run.run_dir import RunDir
    from sptool.run.session import Session

    session = Session(config, RunDir(run_dir), log=log)
    return RunDriver(make_recipe(config, session), resume=resume, on_event=on_event)


def recipe_text(name: str) -> str:
    check_recipe_name(name)
    return resources.files("sptool.recipes").joinpath(f"{name}.toml").read_text(encoding="utf-8")


def _parse_toml(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{source}: not valid TOML: {exc}") from None


def recipe_file(name: str) -> tuple[dict, dict]:
    """The recipe file's settings and its ``[tiny]`` preset (both nested dicts)."""
    document = _parse_toml(recipe_text(name), f"recipes/{name}.toml")
    tiny = document.pop("tiny", {})
    document.pop("recipe", None)
    return document, tiny


# ---------------------------------------------------------------------------- validation & merge

def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean (true/false)"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list [LOW, HIGH]" if len(value) == 2 else "a list"
    return type(value).__name__


def _shown(value: Any) -> str:
    """A TOML value in an error message: JSON where it is JSON, else TOML's own spelling (a
    date, a time)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return f"{type(value).__name__} {value}"


def coerce(key: str, default: Any, value: Any, source: str) -> Any:
    """``value`` checked (and widened int → float) against the type of ``default``."""
    def fail() -> UsageError:
        return UsageError(f"{source}: key '{key}': expected {_type_name(default)}, got {_shown(value)}")

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise fail()
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail()
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail()
        try:
            return float(value)
        except OverflowError:
            raise UsageError(f"{source}: key '{key}': the number {str(value)[:20]}... is too large") from None
    if isinstance(default, str):
        if not isinstance(value, str):
            raise fail()
        return value
    if isinstance(default, list) and all(isinstance(v, str) for v in default):  # strings: any number
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise UsageError(f"{source}: key '{key}': expected a list of non-empty strings, got "
                             f"{_shown(value)}")
        return list(value)
    if isinstance(default, list):
        if not isinstance(value, list) or len(value) != len(default) or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise fail()
        return [float(v) for v in value]
    raise fail()  # pragma: no cover


def _all_keys(schema: dict) -> list[str]:
    return [f"{section}.{key}" for section, keys in schema.items() for key in keys]


def unknown_key_error(key: str, schema: dict, source: str) -> UsageError:
    known = _all_keys(schema)
    close = closest(key, known)
    if not close:  # a bare key name in the wrong or missing section
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == leaf][:1] or \
            closest(leaf, known)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return UsageError(f"{source}: unknown key '{key}'.{hint} (`sptool recipes show NAME` lists them)")


def apply_layer(config: dict, layer: dict, schema: dict, source: str) -> None:
    """Merge ``layer`` (nested dict ``section → key → value``) into ``config``, validating."""
    for section, values in layer.items():
        if not isinstance(values, dict):
            raise unknown_key_error(section, schema, source) if section not in schema else \
                UsageError(f"{source}: '{section}' must be a table of keys")
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if section not in schema or key not in schema[section]:
                raise unknown_key_error(dotted, schema, source)
            config[section][key] = coerce(dotted, schema[section][key], value, source)


def parse_set(assignment: str) -> tuple[str, Any]:
    """``key=value`` from ``--set``; the value is read as TOML (numbers, booleans, lists), else text."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"--set expects KEY=VALUE, got '{assignment}'")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def sets_to_layer(assignments: Iterable[str], recipe: str, schema: dict) -> dict:
    """``--set`` assignments as a layer; a key without a section is looked up in the recipe's
    own section first, then in the shared ones (``--set paths=4`` = ``--set wist.paths=4``)."""
    layer: dict[str, dict] = {}
    for assignment in assignments:
        key, value = parse_set(assignment)
        if "." in key:
            section, name = key.split(".", 1)
        else:
            owners = [s for s in [recipe, *schema] if key in schema.get(s, {})]
            if not owners:
                raise unknown_key_error(key, schema, "--set")
            section, name = owners[0], key
        layer.setdefault(section, {})[name] = value
    return layer


def load_config(recipe: str, *, tiny: bool = False, config_file: str | None = None,
                sets: Iterable[str] = ()) -> dict:
    """The effective configuration: defaults < recipe file < [tiny] < --config < --set."""
    schema = schema_for(recipe)
    config = copy.deepcopy(schema)
    file_layer, tiny_layer = recipe_file(recipe)
    apply_layer(config, file_layer, schema, f"recipes/{recipe}.toml")
    if tiny:
        apply_layer(config, tiny_layer, schema, f"recipes/{recipe}.toml [tiny]")
    if config_file:
        from sptool.core.jsonl import read_text_file

        path = Path(config_file)
        if not path.is_file():
            raise UsageError(f"--config {config_file}: no such file")
        text = read_text_file(path, what="TOML config")
        layer = _parse_toml(text, config_file)
        named = layer.pop("recipe", recipe)
        if named != recipe:
            raise UsageError(f"{config_file}: recipe = '{named}' but --recipe {recipe}")
        layer.pop("tiny", None)
        apply_layer(config, layer, schema, config_file)
    apply_layer(config, sets_to_layer(sets, recipe, schema), schema, "--set")
    check_values(config, recipe)
    config = {"recipe": recipe, "tiny": tiny, **config}
    resolve_prompts(config)
    return config


def check_values(config: dict, recipe: str) -> None:
    """Range checks that the types alone do not catch (declared on the section dataclasses)."""
    from sptool.run.config import section_object
    from sptool.settings import check_ranges

    for section, cls in sections_for(recipe).items():
        check_ranges(section_object(cls, config[section]), lambda key: f"key '{section}.{key}':")
    recipe_class = RECIPES.get(recipe)
    recipe_class.check_section(section_object(recipe_class.Config, config[recipe]))
    if config["train"]["shared_policy"]:
        given = [f"model.{role}" for role in ("questioner", "solver") if config["model"][role]]
        if given:
            raise UsageError(f"key '{given[0]}': a per-role start needs two roles "
                             f"(train.shared_policy = false); use model.policy")


# ---------------------------------------------------------------------------- output

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def to_toml(config: dict, explain: bool = False) -> str:
    """The effective configuration as TOML (readable back by ``--config``); with ``explain``,
    each key is followed by a comment with its help text and source."""
    described = sections_for(config["recipe"]) if explain else {}
    lines = []
    for key, value in config.items():
        if not isinstance(value, dict) and key != "tiny":
            lines.append(f"{key} = {_toml_value(value)}")
    for section, values in config.items():
        if isinstance(values, dict):
            lines.append("")
            lines.append(f"[{section}]")
            for key, value in values.items():
                line = f"{key} = {_toml_value(value)}"
                if section in described:
                    from sptool.settings import help_text

                    line = f"{line:<32} # {help_text(described[section], key)}"
                lines.append(line)
    return "\n".join(lines) + "\n"


def recipe_summary(name: str) -> str:
    """The first comment line of the recipe file."""
    for line in recipe_text(name).splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""
