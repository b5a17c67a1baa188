"""The same record field is checked the same way wherever it is read (issue 26, class 2).

Ids and grouping keys (``group_id``, ``doc_id`` …) are strings or integers, every sample is an
object with a string ``text``, in every stage's input (``records.check_known_fields``), so
``filter`` of every recipe refuses them at ``source:line`` instead of crashing (TypeError on a
list key, KeyError on a sample without text) or training on ``"text": 5``.
"""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES, write_jsonl

RECIPES = ["wist", "svs", "rzero", "rquest", "rlvr"]


def one_line(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sptool: error: "), result.stderr
    return lines[0]


def fixture_records(recipe: str) -> list[dict]:
    name = "verified_svs" if recipe == "rlvr" else f"verified_{recipe}"
    return [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def _first_sampled(records):
    return next(i for i, r in enumerate(records) if isinstance(r.get("samples"), list) and r["samples"])


MUTATIONS = {
    "group_id list": (lambda r: r.__setitem__("group_id", ["a", "b"]), "field 'group_id': expected a string or an integer id, got a list of 2"),
    "doc_id object": (lambda r: r.__setitem__("doc_id", {"x": 1}), "field 'doc_id': expected a string or an integer id, got an object"),
    "sample without text": (lambda r: r["samples"][0].pop("text"), "field 'samples[0].text': expected a string (the completion), got missing"),
    "text 5": (lambda r: r["samples"][0].__setitem__("text", 5), "field 'samples[0].text': expected a string (the completion), got the number 5"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_filter_refuses_bad_ids_and_samples_at_source_line(cli, tmp_path, recipe, mutation):
    records = fixture_records(recipe)
    index = _first_sampled(records)
    mutate, expected = MUTATIONS[mutation]
    mutate(records[index])
    path = write_jsonl(tmp_path / "v.jsonl", records)
    result = cli(["filter", "--recipe", recipe, path, "-o", tmp_path / "g.jsonl"])
    error = one_line(result)
    assert f"{path}:{index + 1}: {expected}" in error, error
    assert not (tmp_path / "g.jsonl").exists()


@pytest.mark.parametrize("question", [5, ["What is 2 + 2?"], {"q": 1}])
def test_decontaminate_refuses_a_question_that_is_not_a_string(cli, question):
    lines = json.dumps({"question": "fine words here"}) + "\n" + json.dumps({"question": question}) + "\n"
    result = cli(["decontaminate", "-b", FIXTURES / "bench" / "leaked.jsonl"], input=lines)
    error = one_line(result)
    assert "<stdin>:2: field 'question': expected a string" in error, error


def test_train_step_refuses_positive_old_logprobs():
    from sptool.core.records import InputError
    from sptool.train.step import TRAINING_GROUP

    group = {"prompt": [{"role": "user", "content": "2+2?"}], "completions": ["4", "5"],
             "rewards": [1.0, 0.0], "advantages": [1.0, -1.0], "old_logprobs": [[-0.5, -0.1], [0.7]]}
    with pytest.raises(InputError) as caught:
        TRAINING_GROUP.validate(group)
    assert "field 'old_logprobs'" in caught.value.message and "0.7" in caught.value.message
    group["old_logprobs"] = [[-0.5, 0.0], [-0.7]]
    assert TRAINING_GROUP.validate(group) is group


def test_local_corpus_line_with_a_number_text_is_an_error(cli, tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "primes are numbers"}, {"text": 5}])
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"path_id": "p", "path": ["mathematics", "primes"]}])
    error = one_line(cli(["corpus", "fetch", paths, "--search", f"local:{corpus}", "--encoder", "none"]))
    assert f"{corpus}:2: field 'text': expected a string or null, got the number 5" in error, error


def test_eval_names_file_line_for_a_missing_answer(cli, tmp_path):
    bench = write_jsonl(tmp_path / "b.jsonl", [{"id": "p1", "question": "1+1?", "answer": "2"},
                                               {"id": "p2", "question": "2+2?"}])
    error = one_line(cli(["eval", bench, "--backend", "scripted", "-k", "1", "--pass-at", "1"]))
    assert f"{bench}:2: field 'answer': missing" in error, error


@pytest.mark.parametrize("line, expected", [
    ({"iteration": "x", "stage": "filter", "records": 3}, "field 'iteration': expected an integer"),
    ({"iteration": 1, "stage": 5, "records": 3}, "field 'stage': expected a string"),
    ({"iteration": 1, "stage": "train", "kind": "train", "records": 1, "roles": 7}, "field 'roles': expected an object"),
    ({"iteration": 1, "stage": "train", "kind": "train", "records": 1, "roles": {"solver": {"groups_with_signal": "2"}}},
     "field 'roles': expected a number for 'solver.groups_with_signal'"),
    ({"iteration": 1, "stage": "verify", "kind": "verify", "records": 2, "wall_s": {}}, "field 'wall_s': expected a number"),
])
def test_report_on_wrong_typed_metrics_is_one_line(cli, tmp_path, line, expected):
    write_jsonl(tmp_path / "metrics.jsonl", [{"iteration": 1, "stage": "solve", "records": 1}, line])
    error = one_line(cli(["report", tmp_path, "-o", tmp_path / "out"]))
    assert f"{tmp_path / 'metrics.jsonl'}:2: {expected}" in error, error


def test_posterior_update_refuses_a_tree_whose_applied_holds_lists(cli, tmp_path):
    tree = json.loads((FIXTURES / "tree.json").read_text())
    tree["applied"] = [["a"], "b"]
    (tmp_path / "t.json").write_text(json.dumps(tree))
    error = one_line(cli(["posterior", "update", "--tree", tmp_path / "t.json"], input=""))
    assert "field 'applied': expected a list of strings (observation keys), item 0 is a list of 1" in error, error


def test_a_samples_record_keeps_its_fields_in_order_drops_the_empty_ones_and_copies_its_lists():
    """``Sample.to_record`` (built by hand, not by ``dataclasses.asdict``): every combination of
    log-probs, token ids and stop string gives the dataclass's fields in order without the None
    ones, token ids only beside log-probs, and lists that are copies."""
    import dataclasses
    import itertools

    from sptool.models.base import Sample

    for logprobs, token_ids, stop in itertools.product([None, [-0.5, -1.25]], [None, [7, 9]], [None, "}"]):
        sample = Sample(text="\\boxed{3}", n_tokens=2, finish_reason="length", logprobs=logprobs,
                        token_ids=token_ids, stop_string=stop)
        record = sample.to_record()
        expected = {key: value for key, value in dataclasses.asdict(sample).items() if value is not None
                    and not (key == "token_ids" and logprobs is None)}
        assert list(record.items()) == list(expected.items())
        if logprobs is not None:
            record["logprobs"].append(0.0)
            assert sample.logprobs == logprobs and len(logprobs) == 2  # a copy
