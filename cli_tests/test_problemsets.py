"""Labelled problem sets in the field's formats (sptool.stages.problemsets): parquet, CSV, JSON, a
`datasets` save_to_disk directory, hf: ids; column mapping and the gsm8k/math/aime/numina presets;
bad rows as one `source:row: field 'x': expected ...` line, exit 2. Every set is built here, in
GSM8K and MATH layouts; nothing reaches the network."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from conftest import read_jsonl, run_sptool, write_jsonl
from test_run import ENV, SCRIPT

GSM8K = [{"question": "Tom has 12 apples and buys 30 more. How many apples does he have?",
          "answer": "He has 12 + 30 = <<12+30=42>>42 apples.\n#### 42"},
         {"question": "A farm sells 1,000 eggs and 234 more. How many eggs?",
          "answer": "1,000 + 234 = 1,234\n#### 1,234"}]
MATH = [{"problem": "What is $\\frac{1}{2} + \\frac{1}{2}$?",
         "solution": "First $\\boxed{2}$ halves, so the sum is $\\boxed{1}$.", "level": "Level 1",
         "type": "Prealgebra"},
        {"problem": "Compute $\\sqrt{16}$.", "solution": "$\\sqrt{16} = \\boxed{4}$.", "level": "Level 1",
         "type": "Prealgebra"}]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def save_to_disk(path: Path, rows: list[dict], split: str | None = None) -> Path:
    import datasets

    data = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: data, "other": data.select([0])}) if split else data).save_to_disk(str(path))
    return path


def read(spec, preset="", question_field="", answer_field="", **options):
    from sptool.stages.problemsets import read_problems
    from sptool.stages.problemsets.columns import Mapping

    return read_problems(str(spec), mapping=Mapping(preset, question_field, answer_field), **options)


def test_each_format_and_preset_reads_the_reference_answers(tmp_path):
    from sptool.core.records import InputError

    gsm = read(write_parquet(tmp_path / "gsm8k.parquet", GSM8K), "gsm8k", need_answer=True)
    assert [(r["question"], r["answer"]) for r in gsm] == [(GSM8K[0]["question"], "42"),
                                                          (GSM8K[1]["question"], "1234")]
    assert gsm[0]["solution"] == GSM8K[0]["answer"]  # the worked solution is kept
    # MATH: the last \boxed{} of the solution; every other column passes through
    for source in (write_csv(tmp_path / "math.csv", MATH), save_to_disk(tmp_path / "math_ds", MATH),
                   write_parquet(tmp_path / "math.parquet", MATH)):
        problems = read(source, "math", need_answer=True)
        assert [(r["question"], r["answer"], r["level"]) for r in problems] == \
            [(MATH[0]["problem"], "1", "Level 1"), (MATH[1]["problem"], "4", "Level 1")], source
    # a DatasetDict directory: its train split, or the one named after @
    dd = save_to_disk(tmp_path / "dd", MATH + MATH, split="train")
    assert len(read(dd, "math")) == 4 and len(read(f"{dd}@other", "math")) == 1
    with pytest.raises(Exception, match="no split 'test'"):
        read(f"{dd}@test", "math")
    # AIME: an integer answer (int column or digits), Problem/Answer capitalised as some sets have it
    (tmp_path / "aime.json").write_text(json.dumps([{"problem": "p1", "answer": 33},
                                                    {"problem": "p2", "answer": "070"}]))
    assert [r["answer"] for r in read(tmp_path / "aime.json", "aime")] == ["33", "70"]
    write_parquet(tmp_path / "aime24.parquet", [{"ID": "2024-I-1", "Problem": "p", "Answer": 204}])
    assert read(tmp_path / "aime24.parquet", "aime")[0]["answer"] == "204"
    # NuminaMath: its answer column, else the last \boxed{} of the solution
    numina = read(write_parquet(tmp_path / "numina.parquet", [
        {"problem": "a", "solution": "\\boxed{5}", "answer": "7"},
        {"problem": "b", "solution": "so \\boxed{x+1}", "answer": "proof"}]), "numina")
    assert [r["answer"] for r in numina] == ["7", "x+1"]
    # explicit columns (JSON Lines in a .json file, as the hub often has them), numbers as text
    write_jsonl(tmp_path / "lines.json", [{"prompt": "What is 2+2?", "target": 4}])
    assert read(tmp_path / "lines.json", question_field="prompt", answer_field="target") == \
        [{"prompt": "What is 2+2?", "target": 4, "question": "What is 2+2?", "answer": "4"}]
    # sptool's own JSONL is read as before
    assert read(write_jsonl(tmp_path / "own.jsonl", [{"question": "q", "answer": "1"}])) == \
        [{"question": "q", "answer": "1"}]
    with pytest.raises(InputError, match="no problems"):
        read(write_jsonl(tmp_path / "empty.jsonl", []))


@pytest.mark.parametrize("fmt", ["parquet", "csv", "disk"])
def test_a_bad_row_is_one_line_naming_source_row_field_and_what_was_expected(tmp_path, fmt):
    from sptool.core.records import InputError

    rows = MATH + [{"problem": "Find x.", "solution": "It is 3.", "level": "Level 2", "type": "Algebra"}]
    source = {"parquet": lambda: write_parquet(tmp_path / "m.parquet", rows),
              "csv": lambda: write_csv(tmp_path / "m.csv", rows),
              "disk": lambda: save_to_disk(tmp_path / "m_ds", rows)}[fmt]()
    row = 4 if fmt == "csv" else 3  # CSV: the file's line (after the header); others: the row
    with pytest.raises(InputError) as error:
        read(source, "math", need_answer=True)
    assert str(error.value) == (f"{source}:{row}: field 'solution': expected a worked solution with a "
                                f"\\boxed{{...}} answer, got the string \"It is 3.\"")
    # no mapping: the missing column is named, with the columns there are and how to map them
    with pytest.raises(InputError) as error:
        read(source, need_answer=True)
    assert str(error.value).startswith(f"{source}:{2 if fmt == 'csv' else 1}: field 'question': missing")
    assert "its columns: problem, solution, level, type" in str(error.value)
    assert "data.question_field" in str(error.value) and "math" in str(error.value)


def test_cli_bad_rows_uncached_hub_id_and_unknown_preset_are_one_line(tmp_path):
    """`sptool eval`/`decontaminate`/`run`: a bad GSM8K row in parquet and a bad CSV row are exit 2
    before any model loads; an uncached hf: id offline is exit 1; a wrong preset is a usage error."""
    bad = write_parquet(tmp_path / "gsm.parquet", GSM8K + [{"question": "q?", "answer": "no final line"}])
    for args in (["eval", str(bad), "--preset", "gsm8k", "--backend", "scripted"],
                 ["run", "--recipe", "rlvr", "--tiny", "--run-dir", str(tmp_path / "r"), "--data", str(bad),
                  "--set", "data.preset=gsm8k", "--backend", "scripted"]):
        result = run_sptool(*args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0] == (f"sptool: error: {bad}:3: field 'answer': expected a GSM8K solution with a "
                            "'#### N' answer line, got the string \"no final line\"")
    assert not (tmp_path / "r").exists()  # refused before the run directory
    bad_csv = write_csv(tmp_path / "bench.csv", [{"problem": "A long enough benchmark problem text"},
                                                 {"problem": ""}])
    result = run_sptool("decontaminate", "-b", str(bad_csv), "--preset", "math", "-q", input="")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"sptool: error: {bad_csv}:3: field 'problem': expected the problem text (a non-empty string), got null"]
    result = run_sptool("eval", "hf:sptool-tests/not-a-cached-set:main@test", "--backend", "scripted",
                        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("sptool: error: hf:sptool-tests/not-a-cached-set:main@test: not in the "
                               "Hugging Face cache and HF_HUB_OFFLINE is set")
    result = run_sptool("eval", str(bad), "--preset", "gsm9k", "--backend", "scripted")
    assert result.returncode == 2 and "unknown data preset 'gsm9k' (one of: gsm8k, math, aime, numina)" in result.stderr
    result = run_sptool("recipes", "show", "rlvr", "--set", "data.preset=gsm9k")
    assert result.returncode == 2 and "data.preset" in result.stderr and "gsm8k" in result.stderr


def test_decontaminate_reads_a_math_layout_benchmark(tmp_path):
    bench = write_parquet(tmp_path / "math500.parquet", [
        {"problem": "Find the number of ordered pairs of positive integers whose product is twelve and sum "
                    "is seven", "solution": "\\boxed{2}", "unique_id": "test/algebra/1.json"}])
    leaked = {"question": "Find the number of ordered pairs of positive integers whose product is twelve "
                          "and sum is seven, please"}
    result = run_sptool("decontaminate", "-b", str(bench), "--preset", "math", "-q",
                        input=json.dumps(leaked) + "\n" + json.dumps({"question": "What is 2 + 2?"}) + "\n")
    assert result.returncode == 0, result.stderr
    assert read_jsonl(result.stdout) == [{"question": "What is 2 + 2?"}]


def test_eval_on_a_math_layout_file_prints_name_size_and_preset(tmp_path):
    """`sptool eval` on a MATH-layout parquet file, the scripted model answering 1 every time:
    the first problem (answer 1) right, the second (answer 4) wrong."""
    bench = write_parquet(tmp_path / "math500.parquet", MATH)
    script = tmp_path / "script.jsonl"
    script.write_text(json.dumps("The sum is \\boxed{1}.") + "\n")
    args = ["eval", str(bench), "--preset", "math", "--backend", "scripted", "-m", str(script), "-k", "2",
            "--pass-at", "1", "--workers", "0"]
    result = run_sptool(*args, "--json", "-q")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["preset"] == "math"
    assert [(b["name"], b["problems"], b["greedy_accuracy"]) for b in report["benchmarks"]] == [("math500", 2, 0.5)]
    result = run_sptool(*args, "-q", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "math500" in line)
    assert [cell.strip() for cell in row.split("│")[1:4]] == ["math500", "2", "math"], result.stdout


@pytest.mark.slow
def test_rlvr_run_from_a_parquet_gsm8k_file_with_the_preset(tmp_path, random_policy):
    """`--data file.parquet --set data.preset=gsm8k` trains (scripted generation, a random
    1-layer policy, LoRA): the sampled problems carry the extracted answers and the policy steps;
    the run exports merged and as an adapter."""
    rows = [{"question": "What is 12 + 30?", "answer": "12 + 30 = 42\n#### 42"},
            {"question": "What is 7 times 8?", "answer": "7 * 8 = 56\n#### 56"}]
    data = write_parquet(tmp_path / "train.parquet", rows)
    bench = write_parquet(tmp_path / "bench.parquet", rows[:1])
    run_dir = tmp_path / "run"
    result = run_sptool("run", "--recipe", "rlvr", "--tiny", "--run-dir", str(run_dir), "--backend", "scripted",
                        "-m", random_policy, "--set", f'model.script="{SCRIPT}"', "--keep", "1", "-q", "-n", "1",
                        "--data", str(data), "--set", "data.preset=gsm8k",
                        "--eval", str(bench), "--set", "eval.preset=gsm8k", "--set", "eval.samples=0",
                        "--set", "train.lora_r=4", env=ENV)
    assert result.returncode == 0, result.stderr
    sampled = read_jsonl(next(run_dir.glob("iter-0001/*-sample.jsonl")))
    assert {(r["question"], r["answer"]) for r in sampled} == {("What is 12 + 30?", "42"), ("What is 7 times 8?", "56")}
    train = [line for line in read_jsonl(run_dir / "metrics.jsonl") if line["kind"] == "train"]
    assert train[-1]["roles"]["policy"]["step"] == 1
    evals = [line for line in read_jsonl(run_dir / "metrics.jsonl") if line["kind"] == "eval"]
    assert [sorted(line["benchmarks"]) for line in evals] == [["bench"], ["bench"]]
    # a LoRA run: exported merged into its base (a plain directory), or as the peft adapter
    assert (run_dir / "ckpt" / "policy" / "step-0001" / "adapter_config.json").is_file()
    check_export(run_dir, tmp_path, str(data), curve=True)
    adapter = tmp_path / "adapter"
    result = run_sptool("export", str(run_dir), "--output", str(adapter), "--adapter", "-q")
    assert result.returncode == 0, result.stderr
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "config.json").exists()
    assert "LoRA adapter (peft)" in (adapter / "README.md").read_text()


# ------------------------------------------------------------------------------ sptool export

def check_export(run_dir: Path, tmp_path: Path, data: str, *, curve: bool) -> Path:
    """`sptool export` of a finished run: a plain HF directory (no sptool_state) with a model card
    naming the recipe, the data's sha256 and the held-out curve; loadable by transformers."""
    import hashlib

    from transformers import AutoModelForCausalLM

    from sptool import __version__
    from sptool.stages.problemsets.sources import source_sha256

    out = tmp_path / "exported"
    result = run_sptool("export", str(run_dir), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() and not (out / "sptool_state").exists()
    card = (out / "README.md").read_text()
    assert "recipe `rlvr`" in card and f"sptool {__version__}" in card and "checkpoint step" in card
    digest = source_sha256(data)
    if Path(data).is_file():
        assert digest == hashlib.sha256(Path(data).read_bytes()).hexdigest()
    assert f"| training set (--data) | `{data}` | `{digest}` |" in card
    assert f"huggingface-cli upload YOUR-NAME/exported {out} ." in card
    assert ("| after iteration | benchmark | greedy |" in card) == curve
    assert (run_dir / "config.toml").read_text().strip() in card
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.num_parameters() > 0
    # a second export onto a non-empty directory, or of a role the run lacks: one line, exit 2
    for args, message in ((["--output", str(out)], "exists and is not empty"),
                          (["--output", str(tmp_path / "x"), "--role", "questioner"], "no checkpoint of role")):
        result = run_sptool("export", str(run_dir), *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    return out
