"""Prompts are configuration: one :class:`PromptSpec` per role, from a packaged name or a file.

A role is a place where sptool asks a model something (:data:`ROLES`): the solver (``solve``,
``validity``), the R-Zero/R-Quest questioner (``questioner``), the WIST challenger
(``challenger``), SvS synthesis (``synthesis``), the novelty judge (``novelty``) and the
tree expansion (``tree``). :func:`load_prompt` resolves a packaged name (``math``, ``direct``,
``arithmetic`` …; :func:`packaged_prompts` lists them) or a template file path into a spec; the
stage commands (``--prompt NAME|FILE``), ``eval`` and ``run`` (``[prompts]``) all call it.

A spec has three parts:

- the **template**, the user message: ``{field}`` placeholders are record fields (``{question}``,
  ``{answer}``, …), substituted literally (no ``str.format``), so LaTeX braces such as
  ``\\boxed{}`` need no escaping;
- an optional **response prefix**: the assistant's reply starts with it (it is rendered after the
  chat template's assistant header and is part of the completion text that parsing sees, e.g. a
  questioner whose reply begins inside ``<question>``);
- optional **stop strings**: generation ends at the first one (kept in the text), with
  ``finish_reason`` ``"stop"``.

The questioner also has an optional answer phase (``answer_prefix``, ``answer_stop``,
``answer_max_tokens``): after the question phase stops, the reply is continued with
``answer_prefix`` and generated until ``answer_stop`` — two short, shape-constrained generations
instead of one free-form one (see :class:`sptool.stages.challenge.QuestionerStage`).
Packaged prompts carry their own prefix and stop strings; explicit values override them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

from sptool.core.records import InputError, UsageError

_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


@dataclass(frozen=True, kw_only=True)
class ReplyShape:
    """How a prompt's reply is shaped: the response prefix and stop strings (and the
    questioner's answer phase); the defaults of a packaged prompt, the settings of a loaded one."""

    prefix: str = ""
    stop: tuple[str, ...] = ()
    answer_prefix: str = ""
    answer_stop: tuple[str, ...] = ()
    answer_max_tokens: int = 16


@dataclass(frozen=True)
class Packaged(ReplyShape):
    """A packaged prompt: its template file and its defaults."""

    file: str
    summary: str


# role -> (what it is, the fields its template must use, the default packaged name). A solver
# prompt without {question} or a judge without both problems cannot work; the other roles'
# templates may use any record field (a challenger prompt about {leaf} instead of {text}).
MAX_DOCUMENT_CHARS = 6000  # a document's characters the challenger prompt shows (WIST); longer ones are cut

ROLES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "solve": ("the solver (solve --mode math, eval)", ("question",), "math"),
    "validity": ("the solver that may answer INVALID (solve --mode validity; R-Quest)", ("question",),
                 "validity"),
    "questioner": ("the questioner (challenge --from nothing; R-Zero, R-Quest)", (), "rzero"),
    "challenger": ("the document challenger (challenge --from documents; WIST)", (), "documents"),
    "synthesis": ("variational problem synthesis (challenge --from solutions; SvS)", (), "solutions"),
    "novelty": ("the same-task judge (novelty; R-Quest)", ("problem_a", "problem_b"), "judge"),
    "tree": ("the topic-tree expansion (tree expand; WIST)", (), "expand"),
}

#: roles whose reply may have an answer step (``ROLE_answer_prefix`` …): the question, then its answer
ANSWER_ROLES = ("questioner", "challenger")

PACKAGED: dict[str, dict[str, Packaged]] = {
    "solve": {
        "math": Packaged("solve_math.txt", "reason step by step, final answer in \\boxed{}"),
        "direct": Packaged("solve_direct.txt", "the final answer only (two worked examples show the "
                           "format): the reply starts with \\boxed{ and ends at } (short token budgets, "
                           "small models)", prefix="\\boxed{", stop=("}",)),
    },
    "validity": {
        "validity": Packaged("solve_validity.txt", "reason step by step, \\boxed{answer} or "
                             "\\boxed{INVALID} for a flawed problem"),
        "direct": Packaged("solve_validity_direct.txt", "the final answer or INVALID only (four examples, "
                           "two flawed): the reply starts with \\boxed{ and ends at }", prefix="\\boxed{",
                           stop=("}",)),
    },
    "questioner": {
        "rzero": Packaged("challenge_nothing.txt", "one hard competition problem in <question></question>, "
                          "then \\boxed{answer} (R-Zero's questioner)"),
        "arithmetic": Packaged("questioner_arithmetic.txt", "one arithmetic word problem (few-shot); the "
                               "reply starts inside <question>, stops at the question, then "
                               "continues with </question> \\boxed{ for the answer (small models)",
                               prefix="<question>", stop=("?", "</question>"),
                               answer_prefix="</question>\n\\boxed{", answer_stop=("}",),
                               answer_max_tokens=12),
        "sums": Packaged("questioner_sums.txt", "one two-digit addition question (few-shot); the reply "
                         "starts inside <question>What is , stops at the question, then continues with "
                         "</question> \\boxed{ for the answer (small models; the held-out sums' form)",
                         prefix="<question>What is ", stop=("?", "</question>"),
                         answer_prefix="</question>\n\\boxed{", answer_stop=("}",),
                         answer_max_tokens=6),
    },
    "challenger": {
        "documents": Packaged("challenge_documents.txt", "one QA pair about a document, as JSON (WIST)"),
        "documents-short": Packaged("challenge_documents_short.txt", "one short question about a document "
                                    "(one example); the reply starts inside <question>, stops at the "
                                    "question, then continues with </question> \\boxed{ for the answer "
                                    "(small models)", prefix="<question>", stop=("?", "</question>"),
                                    answer_prefix="</question>\n\\boxed{", answer_stop=("}",),
                                    answer_max_tokens=12),
    },
    "synthesis": {
        "solutions": Packaged("challenge_solutions.txt", "a variant problem with the same answer in "
                              "<problem></problem> (SvS)"),
        "solutions-short": Packaged("challenge_solutions_short.txt", "a new problem with the same answer, "
                                    "from the problem and its answer (two examples); the reply starts "
                                    "inside <problem> and stops at the question (small models)",
                                    prefix="<problem>", stop=("?", "</problem>")),
    },
    "novelty": {
        "judge": Packaged("novelty_judge.txt", "are two problems the same task type? YES or NO"),
    },
    "tree": {
        "expand": Packaged("tree_expand.txt", "one new subtopic name for a tree node"),
    },
}


@dataclass(frozen=True)
class PromptSpec(ReplyShape):
    """One role's prompt: template, response prefix, stop strings (and the questioner's answer phase)."""

    role: str
    name: str  # the packaged name, or the template file's path
    template: str

    def messages(self, record: dict, **extra) -> list[dict[str, str]]:
        """The chat messages for one record: the filled user message, then the response prefix
        (a trailing assistant message, which every backend renders after the assistant header)."""
        messages = [{"role": "user", "content": fill_template(self.template, record, **extra)}]
        return with_response_prefix(messages, self.prefix)

    def sampling(self, params):
        """``params`` (a :class:`sptool.models.base.SamplingParams`) with this role's stop strings."""
        return dataclasses.replace(params, stop=tuple(self.stop))

    def settings(self) -> dict[str, Any]:
        """What a run records in its config: the name or path, the prefix and the stop strings."""
        data: dict[str, Any] = {"prompt": self.name, "prefix": self.prefix, "stop": list(self.stop)}
        if self.answer_prefix:
            data.update(answer_prefix=self.answer_prefix, answer_stop=list(self.answer_stop),
                        answer_max_tokens=self.answer_max_tokens)
        return data


def with_response_prefix(messages: list[dict[str, str]], prefix: str) -> list[dict[str, str]]:
    """``messages`` plus a trailing assistant message holding ``prefix`` (none when empty)."""
    return messages + [{"role": "assistant", "content": prefix}] if prefix else messages


def packaged_prompts(role: str) -> dict[str, Packaged]:
    """The packaged prompts of ``role`` by name."""
    _check_role(role)
    return PACKAGED[role]


def default_prompt(role: str) -> str:
    _check_role(role)
    return ROLES[role][2]


def _check_role(role: str) -> None:
    if role not in ROLES:
        from sptool.models.base import unknown_name_error

        raise unknown_name_error("prompt role", role, list(ROLES))


def _looks_like_path(value: str) -> bool:
    return "/" in value or "\\" in value or Path(value).suffix != "" or Path(value).exists()


def _stop_tuple(value: str | Iterable[str] | None, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else tuple(value)
    for item in items:
        if not isinstance(item, str) or not item:
            raise UsageError(f"{what}: stop strings must be non-empty strings, got {item!r}")
    return items


def load_prompt(role: str, name_or_path: str | None = None, *, prefix: str | None = None,
                stop: str | Sequence[str] | None = None, answer_prefix: str | None = None,
                answer_stop: str | Sequence[str] | None = None,
                answer_max_tokens: int | None = None) -> PromptSpec:
    """The prompt of ``role`` from a packaged name (``None``: the role's default) or a file path.

    A packaged prompt brings its own prefix and stop strings; a file brings none. Explicit
    ``prefix``/``stop``/``answer_*`` values override either (``""``/``[]`` clear them). A
    template that lacks a field the role fills (``{question}`` for the solver) is refused.
    """
    _check_role(role)
    name = name_or_path or ROLES[role][2]
    packaged = PACKAGED[role].get(name) or next(
        (entry for entry in PACKAGED[role].values() if Path(entry.file).stem == name), None)
    if packaged is not None:
        template = resources.files(__package__).joinpath(packaged.file).read_text(encoding="utf-8")
        shape: ReplyShape = packaged
    elif _looks_like_path(name):
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"{role} prompt file {name} does not exist (give a file path or one of "
                             f"the packaged {role} prompts: {', '.join(PACKAGED[role])})")
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read {role} prompt file {name}: {exc}") from None
        shape = ReplyShape()
    else:
        from sptool.core.registry import unknown_name_error

        raise unknown_name_error(f"{role} prompt", name, PACKAGED[role],
                                 choices=f"Packaged {role} prompts: {', '.join(PACKAGED[role])}; "
                                         "or give a template file path")
    base = {field.name: getattr(shape, field.name) for field in dataclasses.fields(ReplyShape)}
    missing = [field for field in ROLES[role][1] if field not in template_fields(template)]
    if missing:
        raise UsageError(f"{role} prompt {name} has no {{{missing[0]}}} placeholder; the {role} "
                         f"prompt needs {', '.join('{' + f + '}' for f in ROLES[role][1])}")
    if prefix is not None:
        base["prefix"] = prefix
    if answer_prefix is not None:
        base["answer_prefix"] = answer_prefix
    for key, value in (("stop", stop), ("answer_stop", answer_stop)):
        value = _stop_tuple(value, f"{role} {key}")
        if value is not None:
            base[key] = value
    if answer_max_tokens is not None:
        if answer_max_tokens < 1:
            raise UsageError(f"{role} answer_max_tokens must be >= 1, got {answer_max_tokens}")
        base["answer_max_tokens"] = answer_max_tokens
    return PromptSpec(role=role, name=name, template=template, **base)


def prompt_spec(config: dict, role: str) -> PromptSpec:
    """The :class:`PromptSpec` of ``role`` that a run's ``config['prompts']`` section describes
    (per role: the prompt, ``ROLE_prefix``, ``ROLE_stop``; the answer step of ``ANSWER_ROLES`` too)."""
    p = config["prompts"]
    options: dict[str, Any] = dict(prefix=p[f"{role}_prefix"] or None, stop=p[f"{role}_stop"] or None)
    if role in ANSWER_ROLES:
        options.update(answer_prefix=p.get(f"{role}_answer_prefix") or None,
                       answer_stop=p.get(f"{role}_answer_stop") or None,
                       answer_max_tokens=p.get(f"{role}_answer_max_tokens") or None)
    try:
        return load_prompt(role, p[role], **options)
    except UsageError as exc:
        raise UsageError(f"key 'prompts.{role}': {exc}") from None


def load_template(name_or_path: str) -> str:
    """A packaged template file by stem (``solve_math``) or a template file path."""
    path = Path(name_or_path)
    if path.suffix == ".txt" or path.exists():
        if not path.is_file():
            raise UsageError(f"prompt file {name_or_path} does not exist")
        return path.read_text(encoding="utf-8")
    try:
        return resources.files(__package__).joinpath(f"{name_or_path}.txt").read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"no packaged prompt '{name_or_path}'") from None


def fill_template(template: str, record: dict, **extra) -> str:
    """Substitute ``{field}`` placeholders from ``extra`` then ``record``; unknown names stay."""

    def substitute(match: re.Match) -> str:
        key = match.group(1)
        if key in extra:
            return str(extra[key])
        if key in record:
            value = record[key]
            if value is None:
                raise InputError(f"is null but the prompt template needs it", field=key)
            return str(value)
        return match.group(0)

    return _PLACEHOLDER.sub(substitute, template)


def template_fields(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))
