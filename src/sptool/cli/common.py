"""What every stage command shares: the I/O options, progress on stderr and the one-line summary.

The library never imports typer or rich; this module is where they meet it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional

import typer
from rich.console import Console

from sptool.core.fsguard import check_outputs
from sptool.core.jsonl import AtomicJsonlWriter, read_records, source_name
from sptool.core.records import InputError
from sptool.core.stage import Stage

if TYPE_CHECKING:
    from sptool.models.base import SamplingParams

err_console = Console(stderr=True, highlight=False)

# Shared options: the same flag means the same thing in every command.
InputArg = typer.Argument(None, help="Input JSONL file (.gz ok); '-' or nothing reads stdin.",
                          show_default=False)
OutputOpt = typer.Option("-", "-o", "--output", help="Write JSONL here (atomically) instead of stdout.",
                         envvar="SPTOOL_OUTPUT")
QuietOpt = typer.Option(False, "-q", "--quiet", help="No progress or summary on stderr.")
PresetOpt = typer.Option(None, "--preset", help="The problem sets' column layout: gsm8k ('#### N' answer "
                         "line), math (last \\boxed{} of 'solution'), aime (integer 'answer'), numina.")
QuestionFieldOpt = typer.Option(None, "--question-field", help="The column holding the problem (default: "
                                "the preset's, else 'question').")
AnswerFieldOpt = typer.Option(None, "--answer-field", help="The column holding the reference answer "
                              "(default: the preset's, else 'answer').")
SkipInvalidOpt = typer.Option(False, "--skip-invalid",
                              help="Skip bad input lines (counted) instead of stopping with exit 2.")
RejectsOpt = typer.Option(None, "--rejects",
                          help="Write skipped and dropped records here, each with 'reject_reason'.")
SeedOpt = typer.Option(0, "--seed", help="Random seed; same input and seed give the same output.",
                       envvar="SPTOOL_SEED")
ModelOpt = typer.Option("tiny", "-m", "--model", envvar="SPTOOL_MODEL",
                        help="Hugging Face id, local HF directory, or 'tiny' (SmolLM2-135M-Instruct).")
BackendOpt = typer.Option("hf", "--backend", envvar="SPTOOL_BACKEND",
                          help="Generation backend: hf, vllm, openai, scripted.")
TemperatureOpt = typer.Option(1.0, "--temperature", help="Sampling temperature (0: greedy).")
TopPOpt = typer.Option(1.0, "--top-p", help="Nucleus sampling mass.")
NoChatTemplateOpt = typer.Option(False, "--no-chat-template", help="Prompt with plain text (base models).")
GenBatchSizeOpt = typer.Option(64, "--gen-batch-size", help="Sequences per forward batch (hf backend).")
DeviceOpt = typer.Option(None, "--device", envvar="SPTOOL_DEVICE",
                         help="cpu, cuda, cuda:1 … (default: cuda when available).")
DtypeOpt = typer.Option(None, "--dtype", help="auto, bf16, fp16, fp32.")
RequireBoxedOpt = typer.Option(
    False, "--require-boxed",
    help="Grade only \\boxed{} answers (default: a sample without one falls back to math-verify's "
         "own extraction, e.g. 'The final answer is $6$.').")
LogprobsOpt = typer.Option(False, "--logprobs", help="Store per-token log-probabilities.")




BaseUrlOpt = typer.Option(None, "--base-url", envvar="SPTOOL_BASE_URL",
                          help="OpenAI-compatible server(s) for --backend openai, comma-separated (round-robin).")
TensorParallelOpt = typer.Option(1, "--tensor-parallel-size", help="GPUs per model for --backend vllm.")


# ---------------------------------------------------------------------------- option groups

@dataclass
class BackendOptions:
    """Which model to load and how: the option group every generating command shares."""

    model: str = "tiny"
    backend: str = "hf"
    device: Optional[str] = None
    dtype: Optional[str] = None
    gen_batch_size: int = 64
    no_chat_template: bool = False
    base_url: Optional[str] = None
    tensor_parallel_size: int = 1

    def load(self, quiet: bool = False):
        """The generation backend (imports torch & co. only now, inside the command)."""
        from sptool.models.base import load_backend

        return load_backend(self.backend, self.model, device=self.device, dtype=self.dtype,
                            batch_size=self.gen_batch_size, chat_template=not self.no_chat_template,
                            log=stderr_log(quiet), base_url=self.base_url,
                            tensor_parallel_size=self.tensor_parallel_size)


# name -> (annotation, typer option); the parameters backend_options() adds to a command.
_BACKEND_PARAMETERS: dict[str, tuple[Any, Any]] = {
    "model": (str, ModelOpt),
    "backend": (str, BackendOpt),
    "device": (Optional[str], DeviceOpt),
    "dtype": (Optional[str], DtypeOpt),
    "gen_batch_size": (int, GenBatchSizeOpt),
    "no_chat_template": (bool, NoChatTemplateOpt),
    "base_url": (Optional[str], BaseUrlOpt),
    "tensor_parallel_size": (int, TensorParallelOpt),
}


def backend_options(model: Any = ModelOpt) -> Callable[[Callable], Callable]:
    """Decorator (sqlite-utils' ``@output_options`` pattern): add the backend option group to a
    typer command and hand it to the command as one ``backend_options: BackendOptions``.

    ``model`` replaces the ``-m/--model`` option (e.g. a judge model with its own envvar).
    """
    parameters = {name: (annotation, _in_panel(option, "Model and backend"))
                  for name, (annotation, option) in {**_BACKEND_PARAMETERS, "model": (str, model)}.items()}
    return _option_group("backend_options", parameters, BackendOptions)


@dataclass
class PromptOptions:
    """Which prompt to send and how the reply is shaped: ``--prompt NAME|FILE``, ``--prefix``,
    ``--stop`` (the option group of every command that prompts a model)."""

    prompt: Optional[str] = None
    prefix: Optional[str] = None
    stop: Optional[list[str]] = None

    def load(self, role: str):
        """The :class:`sptool.prompts.PromptSpec` of ``role`` these flags describe."""
        from sptool.prompts import load_prompt

        stops = None if not self.stop else [item for item in self.stop if item]
        return load_prompt(role, self.prompt, prefix=self.prefix, stop=stops)


PrefixOpt = typer.Option(None, "--prefix", help="Start the model's reply with this text (after the chat "
                         "template's assistant header; part of the parsed text). Default: the prompt's own.")
StopOpt = typer.Option(None, "--stop", help="End generation at this string (kept in the text); repeat for "
                       "several, --stop '' for none. Default: the prompt's own.")


def prompt_options(*roles: str) -> Callable[[Callable], Callable]:
    """Decorator: add the prompt option group (its ``--prompt`` help lists the packaged prompts of
    ``roles``) and hand it to the command as one ``prompt_options: PromptOptions``."""
    from sptool.prompts import PACKAGED, ROLES

    choices = "; ".join(f"{role}: {', '.join(PACKAGED[role])} (default {ROLES[role][2]})" for role in roles)
    prompt = typer.Option(None, "--prompt", help=f"Packaged prompt name or a template file with {{field}} "
                          f"placeholders. Packaged: {choices}.")
    parameters = {name: (annotation, _in_panel(option, "Prompt")) for name, (annotation, option) in {
        "prompt": (Optional[str], prompt), "prefix": (Optional[str], PrefixOpt),
        "stop": (Optional[List[str]], StopOpt)}.items()}
    return _option_group("prompt_options", parameters, PromptOptions)


def _sampling_params(temperature: float, top_p: float, max_tokens: int, seed: int):
    from sptool.models.base import SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens, seed=seed)


def sampling_options(per: str) -> Callable[[Callable], Callable]:
    """Decorator: add ``--temperature``, ``--top-p``, ``--max-tokens`` and ``--seed`` in place of
    the command's ``sampling`` parameter and hand them over as one ``sampling:
    sptool.models.base.SamplingParams``; ``--max-tokens``'s help counts the tokens per ``per``."""
    max_tokens = typer.Option(512, "--max-tokens", help=f"Maximum new tokens per {per}.")
    return _option_group("sampling", {
        "temperature": (float, TemperatureOpt), "top_p": (float, TopPOpt), "max_tokens": (int, max_tokens),
        "seed": (int, SeedOpt)}, _sampling_params)


@dataclass
class StageIO:
    """How a stage command treats its records: ``--quiet``, ``--skip-invalid``, ``--rejects``."""

    quiet: bool = False
    skip_invalid: bool = False
    rejects: Optional[str] = None

    def run(self, stage: Stage, *, input_path: Optional[str], output: Optional[str], **extra: Any) -> None:
        """:func:`run_stage` with these flags."""
        run_stage(stage, input_path=input_path, output=output, quiet=self.quiet,
                  skip_invalid=self.skip_invalid, rejects=self.rejects, **extra)


def stage_io() -> Callable[[Callable], Callable]:
    """Decorator: add ``--quiet``, ``--skip-invalid`` and ``--rejects`` in place of the command's
    ``stage_io`` parameter and hand them over as one ``stage_io: StageIO``."""
    return _option_group("stage_io", {"quiet": (bool, QuietOpt), "skip_invalid": (bool, SkipInvalidOpt),
                                      "rejects": (Optional[str], RejectsOpt)}, StageIO)


def _option_group(keyword: str, parameters: dict[str, tuple[Any, Any]], build: Callable) -> Callable:
    """The decorator that adds ``parameters`` to a typer command and hands them over as one
    ``keyword`` argument, ``build(**values)``. The options take the place of the command's
    ``keyword`` parameter (so ``--help`` lists them there)."""

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command)
        own = list(signature.parameters)
        at = own.index(keyword) if keyword in own else len(own)  # the options stand where the group does
        kind = signature.parameters[keyword].kind if keyword in own else inspect.Parameter.KEYWORD_ONLY
        added = [inspect.Parameter(name, kind, default=option, annotation=annotation)
                 for name, (annotation, option) in parameters.items()]
        kept = [p for name, p in signature.parameters.items() if name != keyword]

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            group = build(**{name: kwargs.pop(name) for name in parameters})
            return command(*args, **{keyword: group}, **kwargs)

        wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=kept[:at] + added + kept[at:])
        annotations = {k: v for k, v in command.__annotations__.items() if k != keyword}
        wrapper.__annotations__ = {**annotations, **{name: a for name, (a, _) in parameters.items()}}
        return wrapper

    return decorate


def _in_panel(option: Any, panel: str) -> Any:
    option = copy.copy(option)
    option.rich_help_panel = panel
    return option


def stderr_log(quiet: bool) -> Optional[Callable[[str], None]]:
    """A one-argument logger to stderr (None when quiet), for backends and stages."""
    return None if quiet else (lambda message: err_console.print(message, markup=False, soft_wrap=True))


class Progress:
    """Progress on stderr: a live rich line on a terminal, a line every few seconds otherwise."""

    def __init__(self, name: str, quiet: bool, unit: str = "records", every_s: float = 10.0):
        self.name, self.quiet, self.unit, self.every_s = name, quiet, unit, every_s
        self.count = 0
        self.tokens = 0  # generated by the backend (hf), counted after every decoding step
        self.start = time.monotonic()
        self._last = self.start
        self._status = None

    def __enter__(self) -> "Progress":
        if not self.quiet:
            from sptool.models.base import set_token_listener

            set_token_listener(self.tokens_generated)
            if err_console.is_terminal:
                self._status = err_console.status(f"{self.name}: starting")
                self._status.__enter__()
        return self

    def advance(self, n: int = 1) -> None:
        self.count += n
        self._show()

    def tokens_generated(self, n: int) -> None:
        """The backend decoded one more token for ``n`` sequences: a long generation shows
        progress before its first record is done."""
        first = not self.tokens
        self.tokens += n
        self._show(force=first)  # the first decoding step shows at once: the model is working

    def _show(self, force: bool = False) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        text = f"{self.name}: {self.count} {self.unit} ({self.count / elapsed:.2f}/s)"
        if self.tokens:
            text += f", {self.tokens:,} tokens generated ({self.tokens / elapsed:.0f}/s)"
        if self._status is not None:
            self._status.update(text)
        elif force or now - self._last >= self.every_s:
            self._last = now
            err_console.print(text)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start

    def __exit__(self, *exc) -> None:
        if not self.quiet:
            from sptool.models.base import set_token_listener

            set_token_listener(None)
        if self._status is not None:
            self._status.__exit__(*exc)


def waiting_for_stdin_hint(input_path: Optional[str], quiet: bool) -> None:
    if input_path in (None, "-") and sys.stdin is not None and sys.stdin.isatty() and not quiet:
        err_console.print("[dim]sptool: waiting for JSONL on standard input (Ctrl-D to end)…[/dim]")


def run_stage(stage: Stage, *, input_path: Optional[str], output: Optional[str], quiet: bool,
              skip_invalid: bool = False, rejects: Optional[str] = None,
              records: Optional[Iterator[dict]] = None,
              before_commit: Optional[Callable[[], None]] = None) -> None:
    """Read → validate → ``stage.run`` → write, with rejects, progress and the summary line.

    Any :class:`InputError` propagates (the caller's error handler prints one line, exit 2); the
    output file is then left untouched because :class:`AtomicJsonlWriter` discards its temp file.
    An output that is the same file as an input is refused before anything is read.
    ``before_commit`` runs after the last record, before the outputs replace their targets (a
    command that also updates another file does it there, so a failure leaves no new output).
    """
    check_outputs({"--output": output, "--rejects": rejects}, inputs=[input_path])
    waiting_for_stdin_hint(input_path, quiet)
    rejects_writer = AtomicJsonlWriter(rejects, option="--rejects") if rejects else contextlib.nullcontext(None)
    with AtomicJsonlWriter(output) as out, rejects_writer as rejected:

        def on_invalid(error: InputError, raw: str) -> None:
            stage.stats.invalid += 1
            if rejected is not None:
                rejected.write({"reject_reason": error.message, "line": raw.rstrip("\n")})

        def on_drop(record: dict, reason: str) -> None:
            if rejected is not None:
                rejected.write({**record, "reject_reason": reason})

        stage.on_drop = on_drop
        if records is None:
            records = read_records(input_path, stage.input_kind, skip_invalid=skip_invalid,
                                   on_invalid=on_invalid)
        try:
            with Progress(stage.name, quiet) as progress:
                for record in stage.run(records):
                    out.write(record)
                    progress.advance()
        finally:
            stage.close()
        elapsed = progress.seconds
        if before_commit is not None:
            before_commit()
    if not quiet:
        err_console.print(f"{stage.stats.summary(stage.name)} in {elapsed:.1f}s "
                          f"[{source_name(input_path)}]", soft_wrap=True, markup=False)
