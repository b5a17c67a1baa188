"""decontaminate: n-gram and MinHash overlap with benchmark problems, rejects with ids and spans."""

from __future__ import annotations

import json
import random
import re

import pytest

from conftest import read_jsonl, run_sptool, write_jsonl
from sptool.stages.decontaminate import BenchmarkIndex, DecontaminateStage, load_index, normalised_words

NAMES = ["Amira", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jonas", "Keiko",
         "Lars", "Mirela", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sanjay", "Tomasz", "Uma", "Viktor",
         "Wen", "Ximena", "Yusuf", "Zofia"]
ITEMS = ["marbles", "stamps", "apples", "pencils", "seashells", "postcards", "buttons", "coins", "stickers",
         "tulips", "notebooks", "candles", "lemons", "keychains", "badges", "ribbons", "puzzles", "mugs"]
CONTAINERS = ["tin box", "drawer", "basket", "jar", "crate", "suitcase", "shoebox", "cabinet"]
PLACES = ["market", "bookshop", "fair", "bazaar", "corner store", "flea market", "museum shop"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def facts(rng: random.Random) -> dict:
    name, friend = rng.sample(NAMES, 2)
    return {"name": name, "friend": friend, "item": rng.choice(ITEMS), "container": rng.choice(CONTAINERS),
            "place": rng.choice(PLACES), "day": rng.choice(DAYS), "n": rng.randint(20, 99),
            "m": rng.randint(11, 60), "p": rng.randint(2, 19), "k": rng.randint(3, 19),
            "d": rng.randint(2, 30), "r": rng.randint(2, 40)}


def unrelated(rng: random.Random) -> str:
    """Another kind of problem (a little shared wording, no long run)."""
    return (f"A train leaves {rng.choice(PLACES)} station at {rng.randint(1, 11)}:{rng.randint(10, 59)} and "
            f"travels {rng.randint(40, 120)} kilometres per hour for {rng.randint(2, 9)} hours, then stops for "
            f"{rng.randint(5, 50)} minutes. How many kilometres has it covered by the time {rng.choice(NAMES)} "
            f"boards it with {rng.randint(2, 30)} {rng.choice(ITEMS)}?")


def render(f: dict) -> str:
    """The benchmark's wording: 4 sentences, a random slot every few words."""
    return (f"{f['name']} keeps {f['n']} {f['item']} in a {f['container']} at home. "
            f"On {f['day']} {f['name']} buys {f['m']} more {f['item']} at the {f['place']} for {f['p']} dollars each. "
            f"Then {f['name']} gives {f['k']} of them to {f['friend']}, who lives {f['d']} blocks away, "
            f"and {f['friend']} returns {f['r']} a week later. "
            f"How many {f['item']} does {f['name']} have after {f['friend']} returns {f['r']} of them?")


def paraphrase(f: dict) -> str:
    """The same problem in other words and order: no long shared run of words."""
    return (f"Find the count of {f['item']} owned by {f['name']} in the end. "
            f"A week after receiving {f['k']} {f['item']} from {f['name']}, {f['friend']} (a neighbour "
            f"{f['d']} blocks off) hands {f['r']} back. Earlier, at home, a {f['container']} held {f['n']} of "
            f"them, and {f['m']} extra ones were purchased from the {f['place']} on {f['day']} at "
            f"{f['p']} dollars apiece.")


def variant(text: str, rng: random.Random) -> str:
    """Case, whitespace and punctuation changed, the words the same."""
    text = text.upper() if rng.random() < 0.3 else text.lower() if rng.random() < 0.5 else text.swapcase()
    text = re.sub(r" ", lambda _: rng.choice([" ", "  ", "\n", "\t "]), text)
    return text.replace(".", rng.choice([";", "!", " ..."])).replace("?", " ?!").replace(",", "")


def make_data(seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    problem_facts = [facts(rng) for _ in range(50)]
    benchmark = [{"id": f"bench-{i}", "question": render(f), "answer": "0"} for i, f in enumerate(problem_facts)]
    generated = []

    def add(kind, text, source=None):
        generated.append({"id": f"g{len(generated)}", "question": text, "kind": kind, "source": source})

    for i in range(40):
        add("exact", benchmark[i % 50]["question"], f"bench-{i % 50}")
    for i in range(40):
        j = (i * 7) % 50
        add("case/space/punctuation", variant(benchmark[j]["question"], rng), f"bench-{j}")
    for i in range(40):
        j = (i * 3 + 1) % 50
        changed = dict(problem_facts[j], m=problem_facts[j]["m"] + 100)  # one number, mid-problem
        add("one number changed", render(changed), f"bench-{j}")
    for i in range(40):
        add("paraphrase", paraphrase(problem_facts[(i * 11 + 2) % 50]))
    for i in range(40):
        add("unrelated", unrelated(rng))
    rng.shuffle(generated)
    return benchmark, generated


def test_copies_are_dropped_with_their_problem_ids_and_the_rest_kept(tmp_path):
    benchmark, generated = make_data()
    assert len(benchmark) == 50 and len(generated) == 200
    bench_path = write_jsonl(tmp_path / "bench.jsonl", benchmark)
    in_path = write_jsonl(tmp_path / "generated.jsonl", generated)
    rejects = tmp_path / "rejects.jsonl"
    result = run_sptool("decontaminate", "--benchmark", str(bench_path), "--rejects", str(rejects), str(in_path))
    assert result.returncode == 0, result.stderr
    kept = {r["id"]: r for r in read_jsonl(result.stdout)}
    dropped = {r["id"]: r for r in read_jsonl(rejects)}
    by_id = {r["id"]: r for r in generated}
    for record_id, record in by_id.items():
        if record["source"] is None:
            assert record_id in kept, (record["kind"], dropped.get(record_id, {}).get("contamination"))
        else:
            assert record_id in dropped, (record["kind"], record["question"])
            found = dropped[record_id]["contamination"]
            assert found["problem_id"] == record["source"], record["kind"]
            assert found["benchmark"] == str(bench_path)
            assert dropped[record_id]["reject_reason"].startswith("contaminated (")
            span = found["span"].split()
            assert len(span) >= 13 and " ".join(span) in " ".join(normalised_words(record["question"]))
    assert len(kept) == 80 and len(dropped) == 120
    assert "dropped (contaminated (ngram))" in result.stderr


def test_minhash_catches_a_short_near_copy_that_shares_no_long_run(tmp_path):
    problem = ("Compute the sum of all positive divisors of 360 that are also perfect squares, then "
               "subtract 7 from the result.")
    index = BenchmarkIndex([str(write_jsonl(tmp_path / "b.jsonl", [{"id": "div", "question": problem}]))])
    # every 12th word changed: no run of 13 shared words, yet a near-copy
    words = problem.split()
    near = " ".join("seven" if i % 12 == 11 else w for i, w in enumerate(words))
    assert index._ngram_match(normalised_words(near)) is None
    found = index.match(near)
    assert found is not None and found.method == "minhash" and found.problem_id == "div"
    assert found.similarity >= 0.5
    strict = BenchmarkIndex([str(tmp_path / "b.jsonl")], threshold=0.95)
    assert strict.match(near) is None
    assert index.match("Compute the product of the first five primes.") is None


def test_wist_documents_are_checked_by_their_text(tmp_path):
    benchmark, _ = make_data()
    bench_path = write_jsonl(tmp_path / "bench.jsonl", benchmark[:5])
    document = {"id": "doc1", "url": "http://127.0.0.1/page", "title": "Forum",
                "text": "Posted by user123. Can anyone help with this? " + benchmark[3]["question"]
                        + " Thanks in advance, my teacher gave it as homework."}
    clean = {"id": "doc2", "url": "http://127.0.0.1/other", "title": "Rivers",
             "text": "The Danube flows through ten countries and four capital cities on its way to the sea."}
    stage = DecontaminateStage(load_index([str(bench_path)]))
    out = list(stage.run(iter([document, clean, {"id": "x", "other": 1}])))
    assert [r["id"] for r in out] == ["doc2", "x"]
    assert stage.stats.dropped == {"contaminated (ngram)": 1}
    assert document["contamination"]["problem_id"] == "bench-3"


def test_ngram_size_is_configurable_and_short_problems_match_whole(tmp_path):
    bench = write_jsonl(tmp_path / "b.jsonl", [
        {"id": "long", "question": "one two three four five six seven eight nine ten eleven twelve thirteen"},
        {"id": "short", "question": "Find the remainder when 2 to the 100 is divided by 7."},
        {"id": "tiny", "question": "What is 2 + 3?"}])
    index = BenchmarkIndex([str(bench)], threshold=None)
    assert index.match("so: one two three four five six seven eight nine ten eleven twelve thirteen!").problem_id == "long"
    assert index.match("one two three four five six seven eight nine ten eleven twelve") is None
    assert BenchmarkIndex([str(bench)], ngram=5, threshold=None).match(
        "count: four five six seven eight").problem_id == "long"
    # an 11-word problem (< n) counts when it appears whole, inside a longer text
    assert index.match("Homework: find the remainder when 2 to the 100 is divided by 7. Thanks").problem_id == "short"
    # a 4-word problem (< --min-words) counts only as an exact copy
    assert index.match("what is 2+3").problem_id == "tiny"
    assert index.match("Tell me: what is 2 + 3 and why?") is None


def test_the_index_is_built_once_per_process(tmp_path):
    bench = str(write_jsonl(tmp_path / "b.jsonl", [{"question": "a b c d e f g h i j k l m n"}]))
    assert load_index([bench]) is load_index([bench])
    assert load_index([bench]) is not load_index([bench], ngram=5)


@pytest.mark.parametrize("content,expected", [
    ('{"id": "a", "question": "fine problem text"}\nnot json\n', "bench.jsonl:2: not valid JSON"),
    ('{"id": "a", "question": "fine problem text"}\n{"id": "b"}\n', "bench.jsonl:2: field 'question': missing"),
    ('{"id": "a", "question": "?!."}\n', "bench.jsonl:1: field 'question': expected text with words"),
    ('', "bench.jsonl: no problems in the benchmark file"),
])
def test_a_bad_benchmark_file_is_one_line_exit_2_and_no_output(tmp_path, content, expected):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(content)
    data = write_jsonl(tmp_path / "in.jsonl", [{"question": "q"}])
    out = tmp_path / "out.jsonl"
    result = run_sptool("decontaminate", "-b", str(bench), "-o", str(out), str(data))
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_usage_errors(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"question": "q"}])
    result = run_sptool("decontaminate", str(data))
    assert result.returncode == 2 and "--benchmark" in result.stderr
    bench = write_jsonl(tmp_path / "b.jsonl", [{"question": "some words here"}])
    result = run_sptool("decontaminate", "-b", str(bench), "--minhash-threshold", "1.5", str(data))
    assert result.returncode == 2 and "--minhash-threshold must be in (0, 1]" in result.stderr


def test_mark_invalid_keeps_a_contaminated_question_as_invalid(tmp_path):
    benchmark, _ = make_data()
    bench_path = write_jsonl(tmp_path / "bench.jsonl", benchmark[:3])
    stage = DecontaminateStage(load_index([str(bench_path)]), mark_invalid=True)
    records = [{"id": "copy", "question": benchmark[1]["question"]}, {"id": "fine", "question": "What is 2+2?"},
               {"id": "doc", "text": benchmark[2]["question"]}]
    out = list(stage.run(iter(records)))
    assert [r["id"] for r in out] == ["copy", "fine"]          # the document is still dropped
    assert out[0]["valid"] is False and out[0]["contamination"]["problem_id"] == "bench-1"
    assert out[0]["invalid_reason"].startswith("contaminated (ngram): ")
    assert "valid" not in out[1]
