"""Prompts as configuration: packaged names or files per role, a response prefix and stop strings
applied alike by every backend (scripted here; hf with the real tiny model; vllm and openai in
test_backends.py), and the two-step questioner."""

from __future__ import annotations

import json

import pytest

from conftest import read_jsonl, write_jsonl


# ------------------------------------------------------------------------------ load_prompt

def test_every_packaged_prompt_loads_with_its_roles_fields():
    from sptool.prompts import PACKAGED, ROLES, load_prompt, template_fields

    for role, (_, fields, default) in ROLES.items():
        assert default in PACKAGED[role]
        for name in PACKAGED[role]:
            spec = load_prompt(role, name)
            assert spec.role == role and spec.name == name
            assert set(fields) <= template_fields(spec.template), (role, name)
    assert load_prompt("solve").name == "math"  # None: the role's default
    assert load_prompt("solve", "solve_math").template == load_prompt("solve", "math").template  # file stem


def test_packaged_defaults_and_explicit_overrides():
    from sptool.prompts import load_prompt

    direct = load_prompt("solve", "direct")
    assert direct.prefix == "\\boxed{" and direct.stop == ("}",)
    assert load_prompt("solve", "direct", prefix="", stop=[]).prefix == ""
    assert load_prompt("solve", "direct", stop=[]).stop == ()
    assert load_prompt("solve", "direct", stop="\n").stop == ("\n",)
    questioner = load_prompt("questioner", "arithmetic")
    assert questioner.prefix == "<question>" and "</question>" in questioner.stop
    assert questioner.answer_prefix.startswith("</question>") and questioner.answer_stop == ("}",)
    assert questioner.settings()["answer_prefix"] == questioner.answer_prefix
    assert load_prompt("questioner").answer_prefix == ""  # R-Zero's prompt: one free-form reply
    messages = direct.messages({"question": "What is 2 + 3?"})
    assert messages == [{"role": "user", "content": messages[0]["content"]},
                        {"role": "assistant", "content": "\\boxed{"}]
    assert "Problem: What is 2 + 3?" in messages[0]["content"]


def test_prompt_files_and_errors(tmp_path):
    from sptool.prompts import load_prompt
    from sptool.core.records import UsageError

    template = tmp_path / "mine.txt"
    template.write_text("Q: {question}\nA:")
    spec = load_prompt("solve", str(template), prefix=" The answer is", stop=["\n"])
    assert (spec.template, spec.prefix, spec.stop, spec.name) == ("Q: {question}\nA:", " The answer is",
                                                                  ("\n",), str(template))
    assert load_prompt("solve", str(template)).prefix == ""  # a file brings no prefix of its own
    with pytest.raises(UsageError, match=r"unknown solve prompt 'drect'. Did you mean 'direct'\? "
                                         r"Packaged solve prompts: math, direct"):
        load_prompt("solve", "drect")
    with pytest.raises(UsageError, match="prompt file .*nope.txt does not exist"):
        load_prompt("solve", str(tmp_path / "nope.txt"))
    no_field = tmp_path / "noq.txt"
    no_field.write_text("Solve it.")
    with pytest.raises(UsageError, match=r"validity prompt .*noq.txt has no \{question\} placeholder"):
        load_prompt("validity", str(no_field))
    with pytest.raises(UsageError, match="unknown prompt role 'solver'. Did you mean 'solve'"):
        load_prompt("solver")
    with pytest.raises(UsageError, match="stop strings must be non-empty"):
        load_prompt("solve", stop=[""])


def test_cut_at_stop_keeps_the_first_stop_string():
    from sptool.models.base import cut_at_stop

    assert cut_at_stop("How many? 5 </question> more", ("</question>", "?")) == ("How many?", "?")
    assert cut_at_stop("no stop here", ("?",)) == ("no stop here", None)
    assert cut_at_stop("a}b}", ("}",)) == ("a}", "}")
    assert cut_at_stop("anything", ()) == ("anything", None)


# ------------------------------------------------------------------------------ scripted backend

def test_scripted_backend_applies_prefix_and_stop():
    from sptool.models.base import SamplingParams
    from sptool.models.scripted import ScriptedBackend

    backend = ScriptedBackend(outputs=["42} and then more", "\\boxed{7}", "never stops"])
    prompt = [{"role": "user", "content": "What?"}, {"role": "assistant", "content": "\\boxed{"}]
    samples = backend.generate([prompt], 3, SamplingParams(stop=("}",)))[0]
    assert [s.text for s in samples] == ["\\boxed{42}", "\\boxed{7}", "\\boxed{never stops"]
    assert [s.stop_string for s in samples] == ["}", "}", None]
    assert all(s.finish_reason == "stop" for s in samples)
    assert backend.calls[0][0].endswith("What?\n\n\\boxed{")  # the rendered prompt ends with the prefix
    assert samples[0].to_record()["stop_string"] == "}" and "stop_string" not in samples[2].to_record()


def test_solve_cli_direct_prompt_prefix_and_stop(sptool, tmp_path):
    script = write_jsonl(tmp_path / "script.jsonl", ["5} because 2 + 3 = 5", "six}"])
    questions = write_jsonl(tmp_path / "q.jsonl", [{"id": "a", "question": "What is 2 + 3?", "answer": "5"}])
    result = sptool("solve", str(questions), "--backend", "scripted", "-m", str(script), "-k", "2",
                    "--prompt", "direct")
    assert result.returncode == 0, result.stderr
    record = read_jsonl(result.stdout)[0]
    assert [s["text"] for s in record["samples"]] == ["\\boxed{5}", "\\boxed{six}"]
    assert [s["answer"] for s in record["samples"]] == ["5", "six"]
    assert record["solve_prompt"][-1] == {"role": "assistant", "content": "\\boxed{"}
    # the flags override the packaged prompt's own prefix and stop strings
    result = sptool("solve", str(questions), "--backend", "scripted", "-m", str(script), "-k", "1",
                    "--prompt", "direct", "--prefix", "Answer: \\boxed{", "--stop", " ")
    sample = read_jsonl(result.stdout)[0]["samples"][0]
    assert sample["text"] == "Answer: \\boxed{5} " and sample["stop_string"] == " "
    bad = sptool("solve", str(questions), "--backend", "scripted", "-m", str(script), "--prompt", "mth")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1] == ("sptool: error: unknown solve prompt 'mth'. Did you mean "
                                                   "'math'? Packaged solve prompts: math, direct; or give "
                                                   "a template file path")
    validity = sptool("solve", str(questions), "--backend", "scripted", "-m", str(script), "-k", "1",
                      "--mode", "validity", "--prompt", "direct")
    record = read_jsonl(validity.stdout)[0]
    assert "INVALID" in record["solve_prompt"][0]["content"] and record["samples"][0]["answer"] == "5"


def test_questioner_two_step_reply_is_well_formed(sptool, tmp_path):
    # Rules see the rendered prompt: the answer step's prompt ends inside \boxed{.
    script = write_jsonl(tmp_path / "script.jsonl", [
        {"match": r"pens\.</question>\n\\boxed\{$", "output": "nine}"},
        {"match": r"\\boxed\{$", "output": "5} and more"},
        {"match": "", "outputs": ["Tom has 2 cats and 3 dogs. How many pets does he have? Extra.",
                                  "A box has 4 pens.</question>\n\\boxed{4}"]},
    ])
    out = tmp_path / "q.jsonl"
    result = sptool("challenge", "--from", "nothing", "--backend", "scripted", "-m", str(script),
                    "--candidates", "2", "--prompt", "arithmetic", "-o", str(out))
    assert result.returncode == 0, result.stderr
    first, second = read_jsonl(out)
    assert first["raw"] == ("<question>Tom has 2 cats and 3 dogs. How many pets does he have?</question>\n"
                            "\\boxed{5}")
    assert (first["question"], first["questioner_answer"], first["valid"]) == (
        "Tom has 2 cats and 3 dogs. How many pets does he have?", "5", True)
    # the reply closed the question itself: </question> is not repeated
    assert second["raw"] == "<question>A box has 4 pens.</question>\n\\boxed{nine}"
    assert second["question"] == "A box has 4 pens." and second["questioner_answer"] == "nine"
    assert first["questioner_prompt"][-1] == {"role": "assistant", "content": "<question>"}
    assert "logprobs" not in first  # the reply holds forced text between the two steps


def test_novelty_and_challenge_prompt_flags(sptool, tmp_path):
    script = write_jsonl(tmp_path / "script.jsonl", ["NO, different. YES"])
    candidates = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "question": "What is 2 + 3 in total?"},
                                                    {"id": "b", "question": "How many legs has a cat?"}])
    result = sptool("novelty", str(candidates), "--backend", "scripted", "-m", str(script), "--partners", "1",
                    "--prefix", "Verdict:", "--stop", ",")
    assert result.returncode == 0, result.stderr
    compared = read_jsonl(result.stdout)[0]["novelty"]["compared"][0]
    assert compared["raw"] == "Verdict:NO," and compared["verdict"] == "different"
    template = tmp_path / "documents.txt"
    template.write_text("Ask about: {text}")
    docs = write_jsonl(tmp_path / "d.jsonl", [{"id": "d", "text": "Cats have four legs."}])
    bad = sptool("challenge", "--from", "documents", str(docs), "--backend", "scripted", "--prompt",
                 str(tmp_path / "missing.txt"))
    assert bad.returncode == 2 and "challenger prompt file" in bad.stderr.splitlines()[-1]


# ------------------------------------------------------------------------------ the real tiny model

@pytest.mark.slow
def test_hf_prefix_and_stop_with_the_real_tiny_model(tiny_model_dir):
    from sptool.models.base import SamplingParams, load_backend

    backend = load_backend("hf", "tiny", device="cpu")
    try:
        prompt = [{"role": "user", "content": "Count from 1 to 20, separated by commas."},
                  {"role": "assistant", "content": "1, 2, 3,"}]
        rendered = backend.render(prompt)
        assert rendered == backend.render(prompt[:1]) + "1, 2, 3,"
        assert rendered.endswith("<|im_start|>assistant\n1, 2, 3,")
        params = SamplingParams(temperature=0.0, max_new_tokens=24, stop=(" 6",))
        sample = backend.generate([prompt, prompt[:1]], 1, params)
        stopped, free = sample[0][0], sample[1][0]
        assert stopped.text == "1, 2, 3, 4, 5, 6" and stopped.stop_string == " 6"
        assert stopped.finish_reason == "stop" and stopped.n_tokens == len(stopped.token_ids) < 24
        # the ids end with the token that completed the stop string (no EOS), the text right after it
        assert backend.tokenizer.decode(stopped.token_ids).endswith("6")
        assert backend.tokenizer.eos_token_id not in stopped.token_ids
        assert free.stop_string is None or free.text.endswith(" 6")
    finally:
        backend.close()


# ------------------------------------------------------------------------------ PromptEncoder

def test_the_prompt_encoder_pads_a_large_batch_on_threads_exactly_as_the_tokenizer_does(tiny_model_dir):
    """The hf backend's prompts go through PromptEncoder (chunks on threads, padded by hand): its
    ids and mask are the tokenizer call's, whatever padding state the shared tokenizer was left in."""
    import torch

    from sptool.models.tokenizer import PARALLEL_ENCODE_MIN, PromptEncoder, load_tokenizer, render_prompt

    tokenizer = load_tokenizer(tiny_model_dir)
    texts = [render_prompt(tokenizer, [{"role": "user", "content": f"What is {i} + {7 * i}?" + " Think." * (i % 5)}])
             for i in range(2 * PARALLEL_ENCODE_MIN + 3)]
    texts[5], texts[9] = "", "Ünïcödé — ∑ 数学 \\boxed{x}"
    reference = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    for threads in (4, 1):
        encoder = PromptEncoder(tokenizer, threads=threads)
        assert encoder.fast
        # a copy of the encoder for each thread (threads sharing one contend for its cache's lock)
        assert len({id(copy) for copy in encoder.encoders}) == threads
        for batch in (texts, texts[:3]):  # on threads, and one call below PARALLEL_ENCODE_MIN
            input_ids, attention_mask = encoder(batch)
            expected = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            assert torch.equal(input_ids, expected["input_ids"]) and torch.equal(attention_mask, expected["attention_mask"])
    assert int(attention_mask.sum()) < attention_mask.numel()  # rows of several lengths: left padding was tested
    assert torch.equal(PromptEncoder(tokenizer)(texts)[0], reference["input_ids"])
    # the encoder pads its own copy: the shared tokenizer's padding state is untouched
    tokenizer(texts[:2], padding="max_length", max_length=300, add_special_tokens=False)
    assert torch.equal(PromptEncoder(tokenizer)(texts)[1], reference["attention_mask"])


def test_the_text_decoder_decodes_a_large_batch_on_threads_exactly_as_the_tokenizer_does(tiny_model_dir):
    """The hf backend's samples are decoded by TextDecoder (chunks of rows on threads): each text
    is ``tokenizer.decode(ids, skip_special_tokens=True)``, special tokens, empty rows, split
    multi-byte characters and all; a tokenizer that cleans up spaces after decoding is called a row
    at a time."""
    import random

    from sptool.models.tokenizer import PARALLEL_ENCODE_MIN, TextDecoder, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    generator = random.Random(0)
    unicode = tokenizer("Ünïcödé — ∑ 数学 \\boxed{x}", add_special_tokens=False)["input_ids"]
    rows = [[generator.randrange(tokenizer.vocab_size) for _ in range(generator.randrange(1, 40))]
            for _ in range(2 * PARALLEL_ENCODE_MIN + 3)]
    rows[3], rows[7], rows[11] = [], unicode[:-1], unicode + [tokenizer.eos_token_id] + unicode
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in rows]
    assert "<|im_end|>" in tokenizer.decode(rows[11])  # a special token that decoding skips
    for threads in (4, 1):
        decoder = TextDecoder(tokenizer, threads=threads)
        assert decoder.fast and len({id(copy) for copy in decoder.decoders}) == threads
        assert decoder(rows) == expected  # on threads
        assert decoder(rows[:3]) == expected[:3]  # one call below PARALLEL_ENCODE_MIN
    tokenizer.clean_up_tokenization_spaces = True
    assert not TextDecoder(tokenizer).fast
    assert TextDecoder(tokenizer)(rows[:5]) == [tokenizer.decode(ids, skip_special_tokens=True) for ids in rows[:5]]


def test_rendering_many_prompts_at_once_gives_each_prompts_own_text(tiny_model_dir):
    """The hf backend renders a call's prompts with render_prompts (the chat-templated ones in one
    template call): each text is render_prompt's, for chat prompts, response prefixes, system
    messages, empty content and plain strings mixed in one batch, and without a chat template."""
    from sptool.models.tokenizer import load_tokenizer, render_prompt, render_prompts

    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(5)]
    prompts += ["a plain text prompt", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}],
                [{"role": "user", "content": "Sum 2 and 3."}, {"role": "assistant", "content": "\\boxed{"}],
                [{"role": "user", "content": "Ünïcödé ∑"}]]
    calls = []
    template = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *args, **kwargs: calls.append(args) or template(*args, **kwargs)
    for chat_template in (True, False):
        calls.clear()
        texts = render_prompts(tokenizer, prompts, chat_template)
        tokenizer.apply_chat_template = template
        assert texts == [render_prompt(tokenizer, prompt, chat_template) for prompt in prompts]
        tokenizer.apply_chat_template = lambda *args, **kwargs: calls.append(args) or template(*args, **kwargs)
        assert len(calls) == (1 if chat_template else 0)  # one call for the 8 chat prompts
    assert texts[7].endswith("\\boxed{") and "<|im_start|>" not in texts[0]  # no template: plain text
    templated = render_prompts(tokenizer, prompts)
    assert templated[0].startswith("<|im_start|>") and templated[7].endswith("<|im_start|>assistant\n\\boxed{")
