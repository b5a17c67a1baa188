"""``sptool challenge``: the Γ validator, the parsers, each mode with scripted and real models."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES, read_jsonl, write_jsonl
from sptool.stages.challenge import (DocumentChallengeStage, QuestionerStage, SolutionChallengeStage,
                              check_challenger_output, gamma_validate,
                              parse_challenger_json, parse_questioner_output, parse_variant_output,
                              refers_to_document)
from sptool.models.base import SamplingParams
from sptool.models.scripted import ScriptedBackend

DOCUMENTS = FIXTURES / "documents.jsonl"
VERIFIED = FIXTURES / "verified.jsonl"


# ---------------------------------------------------------------- Γ

@pytest.mark.parametrize("question, answer, answer_type, expected", [
    ("What is the least common denominator of 1/4 and 1/6?", "12", "free_form", (True, None)),
    ("What is 2+2?", "4", "free_form", (False, "question too short")),
    ("", "4", "free_form", (False, "missing question")),
    (None, "4", "free_form", (False, "missing question")),
    ("According to the text, what is the least common multiple of 4 and 6?", "12", "free_form",
     (False, "question refers to the document")),
    ("What example does the passage use to illustrate adding fractions?", "1/4", "free_form",
     (False, "question refers to the document")),
    ("Based on the article, by what percent did the price of the item rise?", "25", "free_form",
     (False, "question refers to the document")),
    ("What is the least common multiple of 4 and 6 in this case?", "", "free_form",
     (False, "missing answer")),
    ("What is the least common multiple of 4 and 6 in this case?", None, "free_form",
     (False, "missing answer")),
    ("Explain in detail how one adds fractions with unlike denominators?",
     "You first find a common denominator and then rewrite each fraction and add the numerators",
     "free_form", (False, "answer too long to check")),
    ("How many positive divisors does 360 have? A) 12 B) 20 C) 24 D) 30", "C", "multiple_choice",
     (True, None)),
    ("How many positive divisors does 360 have? A) 12 B) 20 C) 24 D) 30", "(c)", "multiple_choice",
     (True, None)),
    ("How many positive divisors does 360 have? A) 12 B) 20 C) 24 D) 30", "24", "multiple_choice",
     (False, "multiple-choice answer is not an option letter")),
    ("How many positive divisors does 360 have? A) 12 B) 20 C) 24 D) 30", "E", "multiple_choice",
     (False, "multiple-choice answer letter is not an option of the question")),
    ("What is the least common multiple of 4 and 6 in this case?", "12", "essay",
     (False, 'unknown answer_type "essay"')),
    ("What is the least common multiple of 4 and 6 in this case?", 12, "free_form", (True, None)),
])
def test_gamma_validate(question, answer, answer_type, expected):
    assert gamma_validate(question, answer, answer_type) == expected


def test_refers_to_document_leaves_ordinary_words_alone():
    assert not refers_to_document("A text message costs 5 cents; how much do 40 messages cost?")
    assert refers_to_document("In the given passage, which prime appears most often?")


# ---------------------------------------------------------------- parsers

def test_parse_challenger_json_tolerates_fences_and_prose():
    text = ('Sure! Here is my question:\n```json\n{"question": "What is 3/4 + 1/8 as a fraction?", '
            '"correct_answer": "7/8", "answer_type": "free_form"}\n```')
    obj, reason = parse_challenger_json(text)
    assert reason is None and obj["correct_answer"] == "7/8"
    assert parse_challenger_json("no json here") == (None, "no JSON object")
    assert parse_challenger_json('{"q": 1}') == (None, "JSON object has no 'question'")
    # LaTeX with single backslashes is not valid JSON; the parser retries with them doubled
    obj, _ = parse_challenger_json(r'{"question": "Compute \frac{1}{2} + \frac{1}{3} exactly.", "correct_answer": "\frac{5}{6}"}')
    assert obj["correct_answer"] == r"\frac{5}{6}"


def test_check_challenger_output_options_and_defaults():
    out = check_challenger_output(json.dumps({
        "question": "Which number is the number of positive divisors of 360?",
        "options": ["12", "20", "24", "30"], "correct_answer": "C", "answer_type": "Multiple Choice"}))
    assert out["valid"] is True and out["answer_type"] == "multiple_choice"
    assert "C) 24" in out["question"] and out["answer"] == "C"
    out = check_challenger_output('{"question": "What is 5 plus 7 when added together?", "answer": "12"}')
    assert out == {"question": "What is 5 plus 7 when added together?", "answer": "12",
                   "answer_type": "free_form", "valid": True, "invalid_reason": None}


@pytest.mark.parametrize("text, expected", [
    ("<question>Find x if 2x = 10.</question>\n\\boxed{5}", ("Find x if 2x = 10.", "5", None)),
    ("<Question>\nFind x.\n</Question> so \\boxed{\\frac{1}{2}}", ("Find x.", "\\frac{1}{2}", None)),
    ("Find x if 2x = 10. \\boxed{5}", (None, "5", "no <question> tag")),
    ("<question>Find x if 2x = 10.", (None, None, "unclosed <question> (no </question> within the token budget)")),
    ("<question>  </question> \\boxed{5}", (None, "5", "empty question")),
    ("<question>Find x if 2x = 10.</question> x is five", ("Find x if 2x = 10.", None, "no boxed answer")),
])
def test_parse_questioner_output(text, expected):
    assert parse_questioner_output(text) == expected


def test_parse_variant_output():
    assert parse_variant_output("<problem>How many divisors has 2^3*3^2*5?</problem>") == (
        "How many divisors has 2^3*3^2*5?", None)
    assert parse_variant_output("Here is a problem: what is 2+2?") == (None, "no problem extracted")
    assert parse_variant_output("<problem> </problem>") == (None, "empty problem")
    assert parse_variant_output("<problem>What is 7 +  8?</problem>", "What is 7 + 8?")[1] == \
        "copies the original problem"
    # the solutions-short prompt: the reply starts inside <problem> and stops at the question mark
    text = "<problem>Tom has 9 pens and buys 4 more. How many pens does he have?"
    assert parse_variant_output(text, stopped=True) == (text[len("<problem>"):], None)
    assert parse_variant_output(text) == (None, "unclosed <problem> (no </problem> within the token budget)")


def test_short_synthesis_prompt_closes_the_problem_at_the_stop_string(tmp_path):
    """``challenge --from solutions --prompt solutions-short`` through the real tiny model: the
    reply starts inside <problem> and ends at the question mark, so the problem parses without
    a closing tag (the paper's prompt got 0 of 4 well-formed variants from the 135M model)."""
    from sptool.stages.challenge import SolutionChallengeStage
    from sptool.models.base import SamplingParams, load_backend
    from sptool.prompts import load_prompt

    backend = load_backend("hf", "tiny", device="cpu")
    verified = {"id": "p1", "question": "What is 5 + 8?", "answer": "13", "p_hat": 0.5,
                "samples": [{"text": "\\boxed{13}", "correct": True}]}
    stage = SolutionChallengeStage(backend, candidates=4, band=(0.0, 1.0), max_solutions=1,
                                   params=SamplingParams(temperature=1.0, max_new_tokens=48, seed=3),
                                   prompt=load_prompt("synthesis", "solutions-short"))
    out = list(stage.process(iter([verified])))
    assert len(out) == 4
    stopped = [r for r in out if r.get("stop_string") == "?"]
    assert stopped, [r["raw"] for r in out]
    for record in stopped:
        assert record["valid"] and record["question"].endswith("?") and "<problem>" not in record["question"]
        assert record["answer"] == "13" and record["raw"].startswith("<problem>")


# ---------------------------------------------------------------- modes with the scripted backend

GOOD_QA = json.dumps({"question": "What is the least common denominator of 1/4 and 1/6?",
                      "correct_answer": "12", "answer_type": "free_form"})
DOC_QA = json.dumps({"question": "According to the text, what is the sum of 1/4 and 1/6?",
                     "correct_answer": "5/12", "answer_type": "free_form"})


def test_documents_mode_tagged_reply_in_two_phases():
    """The ``documents-short`` challenger (small models): the reply starts inside <question>,
    stops at the question, is continued with </question> \\boxed{ for the answer; Γ judges it as
    a free-form QA."""
    from sptool.prompts import load_prompt

    documents = read_jsonl(DOCUMENTS)[:1]

    def responder(prompt_text: str, index: int) -> str:
        if prompt_text.rstrip().endswith("\\boxed{"):          # the answer phase
            return "12}"
        return ["How many sides do 2 hexagons have?", ""][index]

    backend = ScriptedBackend(responder=responder)
    stage = DocumentChallengeStage(backend, candidates=2, prompt=load_prompt("challenger", "documents-short"),
                                   params=SamplingParams(max_new_tokens=64))
    good, empty = list(stage.run(iter(documents)))
    assert good["raw"] == "<question>How many sides do 2 hexagons have?</question>\n\\boxed{12}"
    assert good["valid"] is True and good["question"] == "How many sides do 2 hexagons have?"
    assert good["answer"] == "12" and good["answer_type"] == "free_form"
    assert empty["valid"] is False and empty["invalid_reason"] == "empty question"
    assert [len(call) for call in backend.calls] == [1, 2]   # the question phase, then both answers


def test_documents_mode_shortest_question_is_a_setting(tmp_path):
    """``wist.min_question_chars``: Γ refuses "What is 89 + 14?" (16 characters) by default and takes
    it at 12, from a prompt file whose reply starts inside "<question>What is " with an answer step
    (the arithmetic WIST domain of ``benchmarks/selfplay.py``); the run config carries the step."""
    from sptool.prompts import load_prompt, prompt_spec
    from sptool.recipes import resolve_prompts, schema_for

    template = tmp_path / "challenger.txt"
    template.write_text("Write one question about: {text}\n", encoding="utf-8")
    config = {"recipe": "wist", "prompts": {**schema_for("wist")["prompts"], "challenger": str(template),
                                            "challenger_prefix": "<question>What is ", "challenger_stop": ["?"],
                                            "challenger_answer_prefix": "</question>\n\\boxed{",
                                            "challenger_answer_stop": ["}"], "challenger_answer_max_tokens": 8}}
    resolve_prompts(config)
    spec = prompt_spec(config, "challenger")
    assert (spec.prefix, spec.answer_prefix, spec.answer_max_tokens) == ("<question>What is ", "</question>\n\\boxed{", 8)
    assert config["prompts"]["challenger_answer_stop"] == ["}"]
    # a packaged prompt's own answer step is written into the config as the questioner's is
    packaged = {"recipe": "wist", "prompts": schema_for("wist")["prompts"] | {"challenger": "documents-short"}}
    resolve_prompts(packaged)
    assert packaged["prompts"]["challenger_answer_prefix"] == load_prompt("challenger", "documents-short").answer_prefix

    def responder(prompt_text: str, index: int) -> str:
        return "103}" if prompt_text.rstrip().endswith("\\boxed{") else "89 + 14?"

    documents = read_jsonl(DOCUMENTS)[:1]
    verdicts = {}
    for shortest in (20, 12):
        stage = DocumentChallengeStage(ScriptedBackend(responder=responder), candidates=1, prompt=spec,
                                       params=SamplingParams(max_new_tokens=16), min_question_chars=shortest)
        (record,) = stage.run(iter(documents))
        assert (record["question"], record["answer"]) == ("What is 89 + 14?", "103")
        verdicts[shortest] = (record["valid"], record["invalid_reason"])
    assert verdicts == {20: (False, "question too short"), 12: (True, None)}


def test_documents_mode_shortest_question_is_a_flag(cli, tmp_path):
    """``challenge --from documents --min-question-chars``: the stage's Γ length rule from the
    command line, as ``wist.min_question_chars`` in a run; below 1 it is a usage error."""
    script = write_jsonl(tmp_path / "script.jsonl", ['{"question": "What is 89 + 14?", "answer": "103", '
                                                     '"answer_type": "free_form"}'])
    verdicts = {}
    for shortest in ("20", "12"):
        result = cli(["challenge", "--from", "documents", DOCUMENTS, "--candidates", "1", "--backend", "scripted",
                      "-m", script, "--min-question-chars", shortest, "-q"])
        assert result.exit_code == 0, result.output
        (first, *_) = read_jsonl(result.stdout)
        assert first["question"] == "What is 89 + 14?"
        verdicts[shortest] = (first["valid"], first["invalid_reason"])
    assert verdicts == {"20": (False, "question too short"), "12": (True, None)}
    result = cli(["challenge", "--from", "documents", DOCUMENTS, "--backend", "scripted", "--min-question-chars", "0"])
    assert result.exit_code == 2 and "--min-question-chars" in result.output


def test_documents_mode_keeps_all_candidates_with_lineage():
    documents = read_jsonl(DOCUMENTS)
    backend = ScriptedBackend(outputs=[GOOD_QA, "I don't know", DOC_QA])
    stage = DocumentChallengeStage(backend, candidates=3, batch_size=2,
                                   params=SamplingParams(max_new_tokens=64))
    out = list(stage.run(iter(documents)))
    assert len(out) == 3 * len(documents)                        # G per document, none dropped
    assert [len(call) for call in backend.calls] == [2, 1]        # batched: 2 documents, then 1
    groups = {}
    for record in out:
        groups.setdefault(record["group_id"], []).append(record)
    assert len(groups) == len(documents)
    for document, (group_id, members) in zip(documents, groups.items()):
        assert {m["doc_id"] for m in members} == {document["id"]}
        assert {m["path_id"] for m in members} == {document["path_id"]}
        assert {m["leaf"] for m in members} == {document["leaf"]}
        assert [m["candidate_index"] for m in members] == [0, 1, 2]
        assert document["text"] in members[0]["challenger_prompt"][0]["content"]
    first = out[:3]
    assert [r["valid"] for r in first] == [True, False, False]
    assert first[0]["answer"] == "12" and first[0]["origin"] == "challenger"
    assert first[1]["invalid_reason"] == "no JSON object" and first[1]["raw"] == "I don't know"
    assert first[2]["invalid_reason"] == "question refers to the document"
    assert all(r["n_tokens"] >= 1 and r["challenger_prompt"][0]["role"] == "user" for r in out)
    assert len({r["id"] for r in out}) == len(out)
    assert stage.stats.notes["valid"] == 3


def test_nothing_mode_groups_and_labels(cli, tmp_path):
    script = write_jsonl(tmp_path / "script.jsonl", [
        "<question>How many subsets of {1,2,3,4} have an even sum?</question>\n\\boxed{8}",
        "I will think of a problem.",
        "<question></question>\\boxed{1}",
        "<question>What is the largest prime factor of 2024?</question>",
    ])
    result = cli(["challenge", "--from", "nothing", "--candidates", "6", "--group-size", "4",
                  "--backend", "scripted", "-m", script, "--seed", "3", "-q"])
    assert result.exit_code == 0, result.output
    out = read_jsonl(result.stdout)
    assert len(out) == 6
    assert [r["invalid_reason"] for r in out] == [None, "no <question> tag", "empty question",
                                                  "no boxed answer", None, "no <question> tag"]
    assert [r["valid"] for r in out] == [True, False, False, False, True, False]
    assert out[0]["question"].startswith("How many subsets") and out[0]["questioner_answer"] == "8"
    assert out[0]["answer"] is None                       # pseudo-labelled later by majority vote
    assert len({r["group_id"] for r in out[:4]}) == 1 and out[4]["group_id"] != out[0]["group_id"]
    assert all(r["origin"] == "questioner" and r["questioner_prompt"][0]["role"] == "user" for r in out)
    assert all("raw" in r and "n_tokens" in r for r in out)
    again = cli(["challenge", "--from", "nothing", "--candidates", "6", "--group-size", "4",
                 "--backend", "scripted", "-m", script, "--seed", "3", "-q"])
    assert again.stdout == result.stdout                  # deterministic


def test_nothing_mode_with_topic_seeds():
    backend = ScriptedBackend(responder=lambda prompt, i: f"<question>Q{i} about {prompt[-40:]}</question> \\boxed{{{i}}}")
    stage = QuestionerStage(backend, candidates=2, batch_size=2, unseeded=False)
    out = list(stage.run(iter([{"id": "t1", "topic": "modular arithmetic", "path_id": "p1"},
                               {"leaf": "graph colouring"}])))
    assert len(out) == 4
    assert "modular arithmetic" in out[0]["questioner_prompt"][0]["content"]
    assert out[0]["topic"] == "modular arithmetic" and out[0]["topic_id"] == "t1" and out[0]["path_id"] == "p1"
    assert out[2]["topic"] == "graph colouring" and out[0]["group_id"] != out[2]["group_id"]


def test_nothing_mode_fills_a_call_with_whole_groups():
    """per_call: 10 problems in groups of 4 (4, 4, 2) take two backend calls, not three, and keep
    the groups of one-group calls (ids, sizes, order)."""
    def responder(prompt, i):
        return f"<question>What is {i} + 1?</question> \\boxed{{{i + 1}}}"

    one = ScriptedBackend(responder=responder)
    per_group = list(QuestionerStage(one, candidates=10, batch_size=4).run(iter(())))
    batched = ScriptedBackend(responder=responder)
    filled = list(QuestionerStage(batched, candidates=10, batch_size=4, per_call=8).run(iter(())))
    assert len(one.calls) == 3 and len(batched.calls) == 2
    assert [len(call) for call in batched.calls] == [2, 1]        # two copies of the prompt, then one
    assert len(filled) == len(per_group) == 10
    assert [r["group_id"] for r in filled] == [r["group_id"] for r in per_group]
    assert [len({r["group_id"] for r in filled[a:b]}) for a, b in ((0, 4), (4, 8), (8, 10))] == [1, 1, 1]
    assert all(r["valid"] for r in filled)


def test_nothing_mode_does_not_read_stdin(sptool, tmp_path):
    script = write_jsonl(tmp_path / "s.jsonl", ["<question>What is 3 cubed plus 1?</question> \\boxed{28}"])
    # stdin is a stream that never ends: the command must not wait for it
    import subprocess, sys
    from conftest import REPO, SPTOOL
    process = subprocess.Popen([*SPTOOL, "challenge", "--from", "nothing", "--candidates", "2", "--backend",
                                "scripted", "-m", str(script)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert len(read_jsonl(stdout)) == 2 and "2 valid" in stderr


def _variant_responder(prompt: str, index: int) -> str:
    if index == 1:
        return "Sorry, I cannot."
    return f"<problem>Variant {index} of: {prompt.split('Solution:')[1][:30].strip()}</problem>"


def test_solutions_mode_band_and_lineage(tmp_path):
    verified = read_jsonl(VERIFIED)
    backend = ScriptedBackend(responder=_variant_responder)
    stage = SolutionChallengeStage(backend, candidates=3, batch_size=4)
    dropped = []
    stage.on_drop = lambda record, reason: dropped.append((record["id"], reason))
    out = list(stage.run(iter(verified)))
    # in band [0.125, 0.5]: sum-frac (2 correct), divisors-360 (4 correct), percent-net (1 correct)
    correct = {"sum-frac": 2, "divisors-360": 4, "percent-net": 1}
    assert len(out) == 3 * sum(correct.values())
    assert sorted(dropped) == [("add-small", "accuracy outside the under-performing band"),
                               ("hard-sum", "accuracy outside the under-performing band")]
    parents = {record["id"]: record for record in verified}
    for record in out:
        parent = parents[record["parent_id"]]
        assert record["answer"] == record["source_answer"] == parent["answer"]
        assert record["origin"] == "synthesis"
        solution = parent["samples"][record["source_solution_index"]]
        assert solution["correct"] is True
        assert solution["text"] in record["synthesis_prompt"][0]["content"]
    assert {r["parent_id"] for r in out} == set(correct)
    for parent_id, count in correct.items():
        assert len({r["group_id"] for r in out if r["parent_id"] == parent_id}) == count
    assert [r["valid"] for r in out[:3]] == [True, False, True]
    assert out[1]["invalid_reason"] == "no problem extracted" and out[1]["question"] is None
    # bounded by --max-solutions; strict band excludes both edges (0.125 and 0.5)
    stage = SolutionChallengeStage(ScriptedBackend(responder=_variant_responder), candidates=2,
                                   max_solutions=1, strict_band=True)
    out = list(stage.run(iter(read_jsonl(VERIFIED))))
    assert {r["parent_id"] for r in out} == {"sum-frac"} and len(out) == 2


def test_solutions_mode_cli_band_option(cli, tmp_path):
    script = write_jsonl(tmp_path / "s.jsonl", ["<problem>A new problem with the same answer.</problem>"])
    rejects = tmp_path / "rejects.jsonl"
    result = cli(["challenge", "--from", "solutions", VERIFIED, "--candidates", "2", "--band", "0.8,1",
                  "--backend", "scripted", "-m", script, "--rejects", rejects])
    assert result.exit_code == 0, result.output
    out = read_jsonl(result.stdout)
    assert {r["parent_id"] for r in out} == {"add-small"} and len(out) == 7 * 2
    assert len(read_jsonl(rejects)) == 4
    assert "4 dropped (accuracy outside the under-performing band)" in result.stderr


# ---------------------------------------------------------------- CLI contract

def test_help(cli):
    result = cli(["challenge", "--help"])
    assert result.exit_code == 0
    for flag in ("--from", "--candidates", "--band", "--max-solutions", "--prompt", "--prompts-per-call", "--group-size"):
        assert flag in result.stdout


def test_empty_input(sptool, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for mode in ("documents", "solutions", "nothing"):
        result = sptool("challenge", "--from", mode, str(empty), "--backend", "scripted")
        assert result.returncode == 0, result.stderr
        assert result.stdout == ""
        assert "0 in, 0 out" in result.stderr


@pytest.mark.parametrize("mode, line, field", [
    ("documents", '{"title": "no text"}', "text"),
    ("solutions", '{"question": "What is 1+1?", "answer": "2", "samples": [{"text": "2"}], "p_hat": 1.0}',
     "samples"),
    ("nothing", '{"topic": 3}', "topic"),
])
def test_bad_line(sptool, tmp_path, mode, line, field):
    path = tmp_path / "bad.jsonl"
    first = {"documents": '{"text": "Fractions need a common denominator to be added."}',
             "solutions": '{"question": "q?", "answer": "1", "samples": [], "p_hat": 0.0}',
             "nothing": '{"topic": "primes"}'}[mode]
    path.write_text(first + "\n" + line + "\n")
    result = sptool("challenge", "--from", mode, str(path), "--backend", "scripted", "-o",
                    str(tmp_path / "out.jsonl"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{path}:2" in lines[0] and f"'{field}'" in lines[0]
    assert not (tmp_path / "out.jsonl").exists()


def test_not_json_line_and_unknown_mode(sptool, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n")
    result = sptool("challenge", "--from", "documents", str(path), "--backend", "scripted")
    assert result.returncode == 2 and f"{path}:1" in result.stderr
    result = sptool("challenge", "--from", "documentz", str(path), "--backend", "scripted")
    assert result.returncode == 2 and "Did you mean 'documents'" in result.stderr


def test_prompt_override(cli, tmp_path):
    template = tmp_path / "mine.txt"
    template.write_text("Write a question about: {leaf}")
    result = cli(["challenge", "--from", "documents", DOCUMENTS, "--candidates", "1", "--prompt", template,
                  "--backend", "scripted", "-q"])
    out = read_jsonl(result.stdout)
    assert out[0]["challenger_prompt"][0]["content"] == "Write a question about: adding fractions"


# ---------------------------------------------------------------- the real tiny model

def _assert_labelled(records):
    assert records
    for record in records:
        assert isinstance(record["valid"], bool)
        assert record["valid"] or record["invalid_reason"]
        assert isinstance(record["raw"], str) and record["n_tokens"] >= 1


@pytest.mark.slow
def test_real_tiny_documents(sptool, tmp_path, tiny_model_dir):
    doc = tmp_path / "one.jsonl"
    doc.write_text(DOCUMENTS.read_text().splitlines()[0] + "\n")
    result = sptool("challenge", "--from", "documents", str(doc), "--candidates", "2", "--max-tokens", "48",
                    "--seed", "1")
    assert result.returncode == 0, result.stderr
    out = read_jsonl(result.stdout)
    assert len(out) == 2 and {r["doc_id"] for r in out} == {"doc-fractions"}
    _assert_labelled(out)


@pytest.mark.slow
def test_real_tiny_nothing(sptool, tiny_model_dir):
    result = sptool("challenge", "--from", "nothing", "--candidates", "2", "--max-tokens", "48", "--seed", "1")
    assert result.returncode == 0, result.stderr
    out = read_jsonl(result.stdout)
    assert len(out) == 2 and all(r["origin"] == "questioner" for r in out)
    _assert_labelled(out)


@pytest.mark.slow
def test_real_tiny_solutions(sptool, tmp_path, tiny_model_dir):
    one = tmp_path / "one.jsonl"
    one.write_text(VERIFIED.read_text().splitlines()[2] + "\n")     # percent-net: 1 correct solution
    result = sptool("challenge", "--from", "solutions", str(one), "--candidates", "2", "--max-tokens", "48")
    assert result.returncode == 0, result.stderr
    out = read_jsonl(result.stdout)
    assert len(out) == 2 and all(r["parent_id"] == "percent-net" and r["answer"] == "-1" for r in out)
    _assert_labelled(out)


def test_pipeline_keeps_invalid_generations(tmp_path):
    """challenge | solve | verify as real processes: invalid generations flow through, unsolved."""
    import shlex
    import subprocess
    from conftest import REPO, SPTOOL

    questioner = write_jsonl(tmp_path / "q.jsonl", [
        "<question>What is the sum of the first ten odd numbers?</question> \\boxed{100}",
        "nothing useful"])
    solver = write_jsonl(tmp_path / "s.jsonl", ["Adding them gives \\boxed{100}"])
    sptool = " ".join(shlex.quote(part) for part in SPTOOL)
    command = (f"{sptool} challenge --from nothing --candidates 2 --backend scripted -m {questioner} -q | "
               f"{sptool} solve -k 2 --backend scripted -m {solver} -q | {sptool} verify -q")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                            text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    valid, invalid = read_jsonl(result.stdout)
    assert valid["valid"] is True and valid["majority"] == "100" and valid["p_hat"] == 1.0
    assert invalid["valid"] is False and invalid["invalid_reason"] == "no <question> tag"
    assert invalid["samples"] == [] and invalid["question"] is None
