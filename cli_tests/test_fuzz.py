"""Property-based fuzzing of the one reader and every stage's record model (issue 26, class 8).

Hostile JSON values (huge integers, lone surrogates, deep nesting, wrong types in every field)
and hostile bytes, in place of a field of a valid record or as a whole line, must end in exit 2
with one ``sptool: error: <stdin>:LINE:`` line, or pass through (exit 0, JSON on stdout): never
a traceback (the in-process runner re-raises any exception). Stages run in-process with the
scripted backend; verify's and train-step's inputs through their record kinds (their commands
start grading workers or load a model). Bounded: a few dozen examples per stage, ~30 s in all.
"""

from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from conftest import FIXTURES  # noqa: E402

FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20), st.sampled_from(["", " ", "\ud800", "x\udfff", "\x00", "\u202e"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                      max_leaves=8)
# raw JSON texts json.dumps cannot write: huge integers, NaN, nesting beyond the reader's bound
RAW_VALUES = st.sampled_from(["7" * 5000, "-" + "9" * 400, "NaN", "1e999", "[" * 3000 + "]" * 3000,
                              '"\\ud800"', '{"a": ' * 200 + "1" + "}" * 200])
BYTES = st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b)


def fixture_records(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


def hostile_line(record: dict, data) -> bytes:
    """One input line: ``record`` with one field replaced (or added) by a hostile value, or a
    hostile raw value, or hostile bytes."""
    how = data.draw(st.sampled_from(["value", "raw", "bytes", "sample"]))
    if how == "bytes":
        return data.draw(BYTES)
    keys = sorted(record) + ["extra"]
    key = data.draw(st.sampled_from(keys))
    if how == "raw":
        text = json.dumps({k: v for k, v in record.items() if k != key}, ensure_ascii=True)
        return (text[:-1] + (", " if len(text) > 2 else "") + json.dumps(key) + ": " + data.draw(RAW_VALUES) + "}").encode()
    mutated = json.loads(json.dumps(record))
    if how == "sample" and isinstance(mutated.get("samples"), list) and mutated["samples"]:
        mutated["samples"][0][data.draw(st.sampled_from(["text", "correct", "answer", "logprobs"]))] = data.draw(VALUES)
    else:
        mutated[key] = data.draw(VALUES)
    return json.dumps(mutated, ensure_ascii=True).encode()


def check_outcome(result, lines: int) -> None:
    assert result.exit_code in (0, 2), (result.exit_code, result.stderr[-1500:])
    if result.exit_code == 2:
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("sptool: error: <stdin>:"), result.stderr
        assert any(f"<stdin>:{n}:" in errors[0] for n in range(1, lines + 1)), errors[0]
    else:
        for line in result.stdout.splitlines():
            if line.strip():
                json.loads(line)  # what passed through is JSON that reads back


def invoke_bytes(args, payload: bytes):
    from typer.testing import CliRunner

    from sptool.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args], input=payload, catch_exceptions=False)


STAGES = {
    "solve": (["solve", "--backend", "scripted", "-k", "1", "-q"], "questions.jsonl"),
    "decontaminate": (["decontaminate", "-b", FIXTURES / "bench" / "leaked.jsonl", "-q"], "questions.jsonl"),
    **{f"filter-{recipe}": (["filter", "--recipe", recipe, "-q"],
                            "verified_svs.jsonl" if recipe == "rlvr" else f"verified_{recipe}.jsonl")
       for recipe in ("wist", "svs", "rzero", "rquest", "rlvr")},
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_inputs_survive_hostile_records(stage):
    args, fixture = STAGES[stage]
    records = fixture_records(fixture)

    @FUZZ
    @given(data=st.data())
    def run(data):
        index = data.draw(st.integers(0, len(records) - 1))
        lines = [json.dumps(r).encode() for r in records]
        lines[index] = hostile_line(records[index], data)
        check_outcome(invoke_bytes(args, b"\n".join(lines) + b"\n"), len(lines))

    run()


def test_posterior_update_survives_hostile_verdicts(tmp_path):
    import shutil

    records = fixture_records("verified_wist.jsonl")
    tree = tmp_path / "tree.json"

    @FUZZ
    @given(data=st.data())
    def run(data):
        shutil.copy(FIXTURES / "tree.json", tree)
        index = data.draw(st.integers(0, len(records) - 1))
        lines = [json.dumps(r).encode() for r in records]
        lines[index] = hostile_line(records[index], data)
        check_outcome(invoke_bytes(["posterior", "update", "--tree", tree, "-q"], b"\n".join(lines) + b"\n"), len(lines))

    run()


@pytest.mark.parametrize("kind_name", ["SOLVED", "TRAINING_GROUP", "LABELLED", "METRICS_LINE"])
def test_record_kinds_refuse_or_accept_writable_records(kind_name, tmp_path):
    """The reader + record kind of verify, train-step, eval and report: an InputError located at
    ``source:line``, or a record the writer can write back."""
    from sptool.core import records as R
    from sptool.core.jsonl import dumps, read_records
    from sptool.core.records import InputError

    if kind_name == "TRAINING_GROUP":
        from sptool.train.step import TRAINING_GROUP as kind
        base = {"prompt": [{"role": "user", "content": "2+2?"}], "completions": ["4", "5"],
                "rewards": [1.0, 0.0], "advantages": [1.0, -1.0], "old_logprobs": [[-0.5], [-0.7]]}
    elif kind_name == "METRICS_LINE":
        from sptool.run.report import METRICS_LINE as kind
        base = {"iteration": 1, "stage": "train", "kind": "train", "records": 2, "wall_s": 0.5,
                "roles": {"solver": {"groups_with_signal": 1}}}
    else:
        kind = getattr(R, kind_name)
        base = fixture_records("verified_svs.jsonl")[0] if kind_name == "SOLVED" else \
            {"id": "p1", "question": "What is 2 + 2?", "answer": "4"}
    path = tmp_path / "in.jsonl"

    @FUZZ
    @given(data=st.data())
    def run(data):
        path.write_bytes(json.dumps(base).encode() + b"\n" + hostile_line(base, data) + b"\n")
        try:
            for record in read_records(path, kind):
                dumps(record).encode("utf-8")
        except InputError as error:
            assert error.message.startswith(f"{path}:"), error.message

    run()
