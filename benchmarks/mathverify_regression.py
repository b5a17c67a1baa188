"""How often `sptool verify` gives math-verify's own expected verdicts on math-verify's regression cases.

math-verify's ``tests/test_all.py`` holds tables of (gold, prediction, expected) collected from
real model outputs. This script reads a local copy of that file (it is not shipped with sptool),
extracts the tables with ``ast`` (the test code itself is never run), and grades every row three
ways: math-verify configured as its tests configure it (the reference), math-verify's
``parse``/``verify`` with their defaults, and ``sptool verify`` (a subprocess, gold as the record's
``answer``, the prediction as its one sample), once lenient (the default) and once with
``--require-boxed``. It prints the agreement with the expected verdicts and the rows that differ.

    python benchmarks/mathverify_regression.py PATH/TO/Math-Verify/tests/test_all.py
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _value(node: ast.AST):
    """A literal cell; an f-string cell (e.g. ``f"{math.sqrt(17):.15f}"``) is evaluated with only
    ``math`` in scope."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        code = compile(ast.Expression(node), "<cell>", "eval")
        return eval(code, {"__builtins__": {}, "math": math})  # noqa: S307 - a table cell


def _compare_config(function: ast.FunctionDef) -> dict:
    """The keyword arguments of the ``compare_strings(...)`` call in a test function's body."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "compare_strings":
            config = {}
            for keyword in node.keywords:
                if isinstance(keyword.value, ast.Name):
                    config[keyword.arg] = ("column", keyword.value.id)
                else:
                    config[keyword.arg] = ast.literal_eval(keyword.value)
            return config
    return {}


def load_cases(path: str) -> list[dict]:
    """Every parametrized (gold, pred, expected[, extra]) row of the file, with its test's config."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    cases = []
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef):
            continue
        for decorator in function.decorator_list:
            if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"):
                continue
            columns = [name.strip() for name in ast.literal_eval(decorator.args[0]).split(",")]
            if columns[:3] != ["gold", "pred", "expected"]:
                continue
            config = _compare_config(function)
            for index, row in enumerate(decorator.args[1].elts):
                values = dict(zip(columns, (_value(cell) for cell in row.elts)))
                resolved = {key: values[value[1]] if isinstance(value, tuple) else value
                            for key, value in config.items()}
                cases.append({"id": f"{function.name}[{index}]", "gold": values["gold"],
                              "pred": values["pred"], "expected": int(values["expected"]),
                              "match_types": resolved.get("match_types", ["latex", "expr"]),
                              "precision": resolved.get("precision", 6),
                              "allow_set_relation_comp": resolved.get("allow_set_relation_comp", False)})
    return cases


def as_tests_configure(case: dict) -> int:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    targets = [LatexExtractionConfig(boxed_match_priority=0) if kind == "latex" else ExprExtractionConfig()
               for kind in case["match_types"]]
    return int(verify(parse(case["gold"], targets), parse(case["pred"], targets),
                      float_rounding=case["precision"],
                      allow_set_relation_comp=case["allow_set_relation_comp"]))


def with_defaults(case: dict) -> int:
    from math_verify import parse, verify

    return int(verify(parse(case["gold"]), parse(case["pred"])))


def sptool_verdicts(cases: list[dict], *extra: str) -> dict[str, int | None]:
    """``sptool verify`` on one record per case: answer = gold, one sample = the prediction."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "cases.jsonl")
        with open(path, "w", encoding="utf-8") as handle:
            for case in cases:
                handle.write(json.dumps({"id": case["id"], "question": "math-verify regression case",
                                         "answer": case["gold"],
                                         "samples": [{"text": case["pred"]}]}) + "\n")
        result = subprocess.run([sys.executable, "-m", "sptool.cli.main", "verify", "-q", path, *extra],
                                capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"sptool verify failed:\n{result.stderr}")
    verdicts = {}
    for line in result.stdout.splitlines():
        record = json.loads(line)
        correct = record["samples"][0]["correct"]
        verdicts[record["id"]] = None if correct is None else int(correct)
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", help="a local copy of math-verify's tests/test_all.py")
    parser.add_argument("--show", type=int, default=50, help="differing rows to print per path")
    args = parser.parse_args()
    cases = load_cases(args.test_file)
    paths = {
        "math-verify as its tests configure it": {c["id"]: as_tests_configure(c) for c in cases},
        "math-verify parse/verify defaults": {c["id"]: with_defaults(c) for c in cases},
        "sptool verify": sptool_verdicts(cases),
        "sptool verify --require-boxed": sptool_verdicts(cases, "--require-boxed"),
    }
    print(f"{len(cases)} (gold, prediction, expected) rows from {args.test_file}")
    print(f"{'path':<42}{'agree':>7}{'of':>5}{'share':>9}")
    for name, verdicts in paths.items():
        agree = sum(verdicts[c["id"]] == c["expected"] for c in cases)
        print(f"{name:<42}{agree:>7}{len(cases):>5}{agree / len(cases):>9.1%}")
    differing = [c for c in cases if paths["sptool verify"][c["id"]] != c["expected"]]
    print(f"\nrows where `sptool verify` differs from the expected verdict ({len(differing)}):")
    for case in differing[:args.show]:
        reference = paths["math-verify as its tests configure it"][case["id"]]
        print(f"  {case['id']}: gold={case['gold']!r} pred={case['pred']!r} expected={case['expected']} "
              f"sptool={paths['sptool verify'][case['id']]} (tests' config: {reference}, "
              f"match_types={case['match_types']}, precision={case['precision']}"
              f"{', allow_set_relation_comp' if case['allow_set_relation_comp'] else ''})")


if __name__ == "__main__":
    main()
