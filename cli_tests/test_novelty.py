"""``sptool novelty``: verdict parsing, the sampled pairwise gate, its O(B·K) cost, the CLI contract."""

from __future__ import annotations

import random
import re

import pytest

from conftest import FIXTURES, read_jsonl, write_jsonl
from sptool.models.scripted import ScriptedBackend
from sptool.stages.novelty import (LexicalJudge, NoveltyStage, draw_comparison_partners, masked_similarity,
                            novelty_pass_probability, parse_same_task_verdict)

BATCH = FIXTURES / "novelty_batch.jsonl"
FAMILIES = {"nb-1": "rectangle", "nb-2": "rectangle", "nb-3": "books", "nb-4": "books"}


@pytest.mark.parametrize("text, expected", [
    ("YES", "same"), ("no", "different"), ("**Yes**, both ask for an area.", "same"),
    ("No. They differ.", "different"), ("\\boxed{YES}", "same"), ("\\boxed{\\text{No}}", "different"),
    ("Let me compare them.\nAnswer: NO", "different"), ("Verdict: same type", "same"),
    ("They are not the same type of task.", "different"), ("These are different tasks.", "different"),
    ("Both are the same kind of problem.", "same"), ("I like turtles", "unparsed"), ("", "unparsed"),
    ("Same setting, but a different question.", "unparsed"),
])
def test_parse_same_task_verdict(text, expected):
    assert parse_same_task_verdict(text) == expected


def test_pass_probability_matches_paper_examples():
    # R-Quest: K = 8 → ≈ 43% at a 10% share, ≈ 6% at 30%; K = 16 at 20% → 2.8%
    assert novelty_pass_probability(0.1, 8) == pytest.approx(0.9 ** 8) == pytest.approx(0.4305, abs=1e-4)
    assert novelty_pass_probability(0.3, 8) == pytest.approx(0.0576, abs=1e-4)
    assert novelty_pass_probability(0.2, 16) == pytest.approx(0.0281, abs=1e-4)


def test_partners_without_replacement_and_never_self():
    partners = draw_comparison_partners(10, 4, random.Random(0))
    for index, others in enumerate(partners):
        assert len(others) == 4 == len(set(others)) and index not in others
    assert draw_comparison_partners(3, 8, random.Random(0))[0] in ([1, 2], [2, 1])  # capped at B − 1


def family_judge(prompt: str, _index: int) -> str:
    """Scripted judge: same family of task ↔ YES; an unparseable answer for one pair kind."""
    a, b = re.search(r"Problem A:\n(.*?)\n\nProblem B:\n(.*?)\n", prompt, re.DOTALL).groups()
    family = lambda text: ("rectangle" if "rectangle" in text else "books" if "books" in text else text)
    if "dice" in a and "derivative" in b:
        return "hmm"
    return "YES" if family(a) == family(b) else "NO, a different task."


def test_scripted_judge_marks_paraphrases_not_novel():
    records = read_jsonl(BATCH)
    judge = ScriptedBackend(responder=family_judge)
    stage = NoveltyStage(judge, k=7, seed=0)
    out = list(stage.run(iter(records)))
    assert [r["id"] for r in out] == [r["id"] for r in records]     # order kept, nothing dropped
    by_id = {r["id"]: r for r in out}
    for id_ in ("nb-1", "nb-2", "nb-3", "nb-4"):
        assert by_id[id_]["novelty"]["novel"] is False
        same = [c["id"] for c in by_id[id_]["novelty"]["compared"] if c["verdict"] == "same"]
        assert same and all(FAMILIES.get(other) == FAMILIES[id_] for other in same)
    for id_ in ("nb-5", "nb-6", "nb-7", "nb-8"):
        assert by_id[id_]["novelty"]["novel"] is True
    unparsed = [c for c in by_id["nb-7"]["novelty"]["compared"] if c["verdict"] == "unparsed"]
    assert unparsed == [{"id": "nb-8", "verdict": "unparsed", "raw": "hmm"}]   # recorded, counted as not same
    assert by_id["nb-bad"] == records[-1]                                      # invalid: untouched
    assert by_id["nb-1"]["novelty"]["judge"] == "scripted"
    assert stage.stats.notes["passed through (valid=false)"] == 1
    # every judgement greedy and batched: B·K prompts, B = 8 valid candidates, K = 7
    assert sum(len(call) for call in judge.calls) == 8 * 7
    assert all("nb-bad" not in c["id"] for r in out[:8] for c in r["novelty"]["compared"])


def test_masked_similarity_by_hand():
    # numbers masked: "tom has # apples." both ways, identical
    assert masked_similarity("Tom has 3 apples.", "Tom  has 12 apples.") == 1.0
    # "ab#" vs "ac#": Indel distance 2 (drop b, insert c) over 6 characters: 1 - 2/6
    assert masked_similarity("ab1", "AC22") == pytest.approx(1 - 2 / 6)
    assert masked_similarity("Each bag has 6 cookies. How many cookies are in 5 bags?",
                             "What is the derivative of x^3 + 2x?") < 0.5


def test_lexical_judge_marks_a_reused_template_not_novel():
    """The lexical judge (a model too small to judge): a template re-asked with other numbers is
    the same type; unrelated problems are not; every pair is still B·K judgements."""
    records = [{"id": "t1", "question": "Tom has 3 apples and buys 5 more. How many apples does Tom have now?"},
               {"id": "t2", "question": "Tom has 8 apples and buys 2 more. How many apples does Tom have now?"},
               {"id": "u1", "question": "What is the derivative of x^3 + 2x?"},
               {"id": "u2", "question": "A circle has radius 3. What is its area?"}]
    out = {r["id"]: r["novelty"] for r in NoveltyStage(LexicalJudge(0.6), k=3, seed=0).run(iter(records))}
    assert out["t1"]["novel"] is False and out["t2"]["novel"] is False
    assert out["u1"]["novel"] is True and out["u2"]["novel"] is True
    same = [c for c in out["t1"]["compared"] if c["verdict"] == "same"]
    assert [c["id"] for c in same] == ["t2"] and same[0]["raw"] == "similarity 1.000"
    assert out["t1"]["judge"] == "lexical" and all(len(n["compared"]) == 3 for n in out.values())
    with pytest.raises(Exception, match="threshold"):
        LexicalJudge(0.0)


def test_on_a_task_of_one_template_only_a_repeated_question_is_the_same():
    """Two-digit sums are one task type: the number-masked gate finds every sum the same type, so no
    sum is novel and R-Quest's questioner is paid for none (H200 run 5: 0-5% novel). Unmasked, at
    similarity 1.0, only a repeated question (case and spaces aside) is the same."""
    sums = [{"id": f"s{i}", "question": f"What is {a} + {b}?"} for i, (a, b) in enumerate([(12, 9), (47, 38), (5, 61)])]
    repeat = {"id": "r", "question": "what is  12 + 9?"}
    masked = {r["id"]: r["novelty"]["novel"] for r in NoveltyStage(LexicalJudge(0.6), k=3, seed=0).run(iter(sums))}
    assert masked == {"s0": False, "s1": False, "s2": False}
    records = [dict(r) for r in sums] + [repeat]
    judge = LexicalJudge(1.0, mask_numbers=False)
    out = {r["id"]: r["novelty"] for r in NoveltyStage(judge, k=3, seed=0).run(iter(records))}
    assert {key: value["novel"] for key, value in out.items()} == {"s0": False, "s1": True, "s2": True, "r": False}
    assert [c["id"] for c in out["r"]["compared"] if c["verdict"] == "same"] == ["s0"]
    assert judge.judge([("What is 12 + 9?", "What is 13 + 9?")])[0][0] == "different"


def test_cost_is_batch_times_k_and_seeded():
    records = read_jsonl(BATCH)
    judge = ScriptedBackend(outputs=["NO"])
    stage = NoveltyStage(judge, k=3, seed=5, judge_batch_size=10)
    out = list(stage.run(iter(records)))
    assert sum(len(call) for call in judge.calls) == 8 * 3          # O(B·K), not B(B−1) = 56
    assert [len(call) for call in judge.calls] == [10, 10, 4]       # batched through the backend
    assert all(len(r["novelty"]["compared"]) == 3 for r in out[:8])
    again = list(NoveltyStage(ScriptedBackend(outputs=["NO"]), k=3, seed=5).run(iter(read_jsonl(BATCH))))
    assert [r.get("novelty") for r in again] == [r.get("novelty") for r in out]
    other = list(NoveltyStage(ScriptedBackend(outputs=["NO"]), k=3, seed=6).run(iter(read_jsonl(BATCH))))
    assert [r.get("novelty") for r in other] != [r.get("novelty") for r in out]


def test_batches_are_independent():
    records = read_jsonl(BATCH)[:8]
    judge = ScriptedBackend(outputs=["NO"])
    out = list(NoveltyStage(judge, k=8, batch_size=4).run(iter(records)))
    # partners come from the record's own batch of 4 only: 3 each, 2 batches → 8 × 3 judgements
    assert sum(len(call) for call in judge.calls) == 24
    first_batch = {r["id"] for r in out[:4]}
    assert all({c["id"] for c in r["novelty"]["compared"]} <= first_batch for r in out[:4])


def test_cli_scripted(cli, tmp_path):
    script = write_jsonl(tmp_path / "judge.jsonl", [
        {"match": "(?s)rectangle.*Problem B:.*rectangle", "output": "YES"},
        {"match": "(?s)books.*Problem B:.*books", "output": "Yes"}, "NO"])
    result = cli(["novelty", BATCH, "--partners", "7", "--backend", "scripted", "-m", script])
    assert result.exit_code == 0
    out = read_jsonl(result.stdout)
    assert [r["novelty"]["novel"] for r in out[:8]] == [False] * 4 + [True] * 4
    assert "56 judgements" in result.stderr and "4 not novel" in result.stderr


def test_help(cli):
    result = cli(["novelty", "--help"])
    assert result.exit_code == 0 and "--partners" in result.stdout and "--candidates-per-batch" in result.stdout


def test_empty_input(sptool, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = sptool("novelty", str(empty), "--backend", "scripted")
    assert result.returncode == 0 and result.stdout == "" and "0 in, 0 out" in result.stderr


@pytest.mark.parametrize("line, needle", [
    ('{"question": "   "}', "field 'question'"),
    ('{"question": 7}', "field 'question'"),
    ("not json", "not valid JSON"),
])
def test_bad_line(sptool, tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "What is 2 + 2 in base 3?"}\n' + line + "\n")
    result = sptool("novelty", str(path), "--backend", "scripted")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{path}:2" in lines[0] and needle in lines[0]


@pytest.mark.slow
def test_real_tiny_judge(sptool, tmp_path, tiny_model_dir):
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(BATCH.read_text().splitlines(keepends=True)[:3]))
    result = sptool("novelty", str(batch), "--partners", "2", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    out = read_jsonl(result.stdout)
    assert len(out) == 3
    for record in out:
        novelty = record["novelty"]
        assert isinstance(novelty["novel"], bool) and len(novelty["compared"]) == 2
        assert all(c["verdict"] in ("same", "different", "unparsed") for c in novelty["compared"])
        assert novelty["novel"] == (not any(c["verdict"] == "same" for c in novelty["compared"]))
    assert "6 judgements" in result.stderr
