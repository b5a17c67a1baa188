"""One validator for options and settings (issue 26, class 3).

Every number setting has a type, a range and an upper bound that keeps a run finite (declared,
else the option table's entry of the same name, else a generic cap); every choice is checked with
did-you-mean; all of it before any file is written, for ``run``, ``recipes show --set`` and TOML
alike, naming the key. Options get the same checks, and typer's own conversion errors come out
in sptool's one-line ``sptool: error:`` form, exit 2.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import FIXTURES


def one_line(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sptool: error: "), result.stderr
    return lines[0]


BAD_SETTINGS = [
    ("svs", "generation.top_p=5", "key 'generation.top_p': must be in (0, 1], got 5.0"),
    ("rquest", "rquest.init_top_p=5", "key 'rquest.init_top_p': must be in (0, 1], got 5.0"),
    ("rquest", "rquest.novelty_similarity=5", "key 'rquest.novelty_similarity': must be in (0, 1]"),
    ("wist", "wist.duplicate_threshold=5", "key 'wist.duplicate_threshold': must be in (0, 1]"),
    ("svs", "run.seed=-1", "key 'run.seed': must be in [0, 4294967295], got -1"),
    ("svs", "run.seed=18446744073709551616", "key 'run.seed': must be in [0, 4294967295]"),
    ("svs", "generation.temperature=1e9", "key 'generation.temperature': must be in [0, 100]"),
    ("svs", "train.learning_rate=5", "key 'train.learning_rate': must be in (0, 1], got 5.0"),
    ("svs", "train.max_grad_norm=-1", "key 'train.max_grad_norm': must be in [0, "),
    ("rzero", "rzero.bleu_threshold=2", "key 'rzero.bleu_threshold': must be in [0, 1], got 2.0"),
    ("wist", "wist.tau_var=5", "key 'wist.tau_var': must be in [0, 1], got 5.0"),
    ("wist", "wist.tau_var=-5", "key 'wist.tau_var': must be in [0, 1], got -5.0"),
    ("wist", "wist.tau_emb=9", "key 'wist.tau_emb': must be in [-1, 1], got 9.0"),
    ("svs", "verify.deadline_s=1e300", "key 'verify.deadline_s': must be in (0, 604800]"),
    ("svs", "run.iterations=1000000000000", "key 'run.iterations': must be in [1, 1000000]"),
    ("svs", 'train.loss="grpoo"', "key 'train.loss': unknown value 'grpoo'. Did you mean 'grpo'?"),
    ("svs", 'model.backend="bogus"', "key 'model.backend': unknown value 'bogus'. Choose from: hf, openai, scripted, vllm"),
    ("svs", 'model.device="quantum"', "key 'model.device': unknown device 'quantum'"),
    ("svs", 'model.dtype="fp7"', "key 'model.dtype': unknown value 'fp7'"),
]


@pytest.mark.parametrize("recipe, assignment, expected", BAD_SETTINGS)
def test_recipes_show_set_checks_every_setting(cli, recipe, assignment, expected):
    error = one_line(cli(["recipes", "show", recipe, "--set", assignment]))
    assert expected in error, error


@pytest.mark.parametrize("recipe, assignment, expected",
                         [BAD_SETTINGS[0], BAD_SETTINGS[10], BAD_SETTINGS[15], BAD_SETTINGS[13]])
def test_run_refuses_bad_settings_before_any_file_is_written(cli, tmp_path, recipe, assignment, expected):
    run_dir = tmp_path / "run"
    error = one_line(cli(["run", "--recipe", recipe, "--tiny", "--run-dir", run_dir, "--backend", "scripted",
                          "--set", assignment]))
    assert expected in error, error
    assert not run_dir.exists()


def test_toml_settings_are_checked_and_name_the_key(cli, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('recipe = "svs"\n[generation]\ntop_p = 5\n')
    assert "key 'generation.top_p': must be in (0, 1]" in one_line(cli(["recipes", "show", "svs", "--config", config]))


def test_every_number_setting_has_an_upper_bound():
    from sptool.recipes import RECIPES, sections_for
    from sptool.settings import bounds

    for recipe in RECIPES.names():
        for section, cls in sections_for(recipe).items():
            for field in dataclasses.fields(cls):
                if isinstance(field.default, (int, float)) and not isinstance(field.default, bool):
                    low, _, high, _ = bounds(field)
                    assert high is not None and low is not None, f"{section}.{field.name}"


@pytest.mark.parametrize("args, expected", [
    (["train-step", "--device", "quantum", "-o", "{tmp}/ckpt", "{tmp}/none.jsonl"], "--device: unknown device 'quantum'"),
    (["train-step", "--mixed-precision", "fp8", "-o", "{tmp}/ckpt", "{tmp}/none.jsonl"], "--mixed-precision: unknown mixed precision 'fp8'"),
    (["solve", "--device", "quantum"], "--device: unknown device 'quantum'"),
    (["solve", "--dtype", "fp7"], "--dtype: unknown dtype 'fp7'. Choose from: auto, bf16"),
    (["tree", "expand", "--tree", "{tmp}/t.json", "--wiki-api", "bogus"], "--wiki-api: unknown wiki api 'bogus'"),
    (["decontaminate", "--min-words", "-1", "-b", str(FIXTURES / "bench" / "leaked.jsonl")], "--min-words must be in [1, "),
    (["solve", "--stop", "", "--backend", "scripted"], "--stop must be a non-empty string"),
    (["eval", str(FIXTURES / "bench" / "leaked.jsonl"), "--pass-at", "1,,2", "--backend", "scripted"], "--pass-at expects comma-separated integers"),
    (["serve", "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization must be a finite number"),
    (["serve", "--gpu-memory-utilization", "inf"], "--gpu-memory-utilization must be a finite number"),
    (["serve", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
    (["serve", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be in (0, 1]"),
    (["serve", "--max-model-len", "0"], "--max-model-len must be in [1, "),
    (["run", "--recipe", "svs", "--tiny", "--run-dir", "{tmp}/run", "-n", "1" + "0" * 30], "-n/--iterations must be in [1, 1000000]"),
    (["data", "gym", "chain_sum", "-n", "1" + "0" * 30], "-n/--count must be in [1, 10000000]"),
    (["data", "gym", "chain_sum", "--param", "max_digits=1e308"], "--param max_digits=1e308: must be within"),
    (["solve", "-k", "abc", "--backend", "scripted"], "Invalid value for '-k' / '--samples'"),
    (["solve", "--temperature", "1,5", "--backend", "scripted"], "Invalid value for '--temperature'"),
    (["verify", "--deadline", "soon"], "Invalid value for '--deadline'"),
])
def test_bad_options_are_one_line_before_any_work(cli, tmp_path, args, expected):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    error = one_line(cli(args, input='{"question": "q"}\n'))
    assert expected in error, error
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "run").exists()


def test_range_error_checks_the_maximum_when_the_lower_bound_is_open():
    from sptool.settings import range_error, setting

    @dataclasses.dataclass
    class Options:
        share: float = setting(0.5, "a share", above=0, maximum=1)

    field = dataclasses.fields(Options)[0]
    assert range_error(field, 5.0) == "must be in (0, 1], got 5.0"
    assert range_error(field, 0.0) == "must be in (0, 1], got 0.0"
    assert range_error(field, 1.0) is None
