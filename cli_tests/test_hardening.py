"""Hardening (issue 18): no input destroyed, no silent corruption, real deadlines, one line for
every failure. Each test reproduces one defect found by a reliability review and checks the fix
with the real CLI in a subprocess (real files, FIFOs, devices, servers on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES, REPO, SPTOOL, read_jsonl, run_sptool, write_jsonl

SOLVED = {"id": "s1", "question": "What is 1+1?", "answer": "2",
          "samples": [{"text": "so \\boxed{2}"}, {"text": "\\boxed{3}"}]}


def one_error_line(result, code: int = 2) -> str:
    """The run failed with ``code`` and exactly one line on stderr (no traceback); that line."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---------------------------------------------------------------- 1. data loss

@pytest.fixture
def verified_wist(tmp_path):
    source = tmp_path / "in.jsonl"
    shutil.copy(FIXTURES / "verified_wist.jsonl", source)
    return source


def test_rejects_naming_the_input_is_refused_and_the_input_survives(verified_wist, tmp_path):
    before = verified_wist.read_bytes()
    result = run_sptool("filter", "--recipe", "wist", str(verified_wist), "--rejects", str(verified_wist),
                        "-o", str(tmp_path / "g.jsonl"))
    line = one_error_line(result)
    assert "--rejects" in line and "same file as the input" in line
    assert verified_wist.read_bytes() == before
    assert not (tmp_path / "g.jsonl").exists()


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_output_that_is_the_input_is_refused(verified_wist, tmp_path, how):
    before = verified_wist.read_bytes()
    target = verified_wist
    if how == "symlink":
        target = tmp_path / "link.jsonl"
        target.symlink_to(verified_wist)
    elif how == "hardlink":
        target = tmp_path / "hard.jsonl"
        os.link(verified_wist, target)
    result = run_sptool("filter", "--recipe", "wist", str(verified_wist), "-o", str(target))
    assert "same file as the input" in one_error_line(result)
    assert verified_wist.read_bytes() == before


def test_output_that_is_another_input_is_refused(tmp_path):
    """--replay, --prompt, --tree …: any file a command reads is protected, not only INPUT."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Solve: {question}\n")
    source = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1?"}])
    result = run_sptool("solve", "--backend", "scripted", str(source), "--prompt", str(prompt),
                        "-o", str(prompt))
    assert "--output" in (line := one_error_line(result)) and f"same file as the input {prompt}" in line
    assert prompt.read_text() == "Solve: {question}\n"


def test_output_from_stdin_input_file_is_refused(verified_wist):
    before = verified_wist.read_bytes()
    with open(verified_wist) as stdin:
        result = subprocess.run([*SPTOOL, "filter", "--recipe", "wist", "-o", str(verified_wist)],
                                stdin=stdin, capture_output=True, text=True, cwd=REPO)
    assert "same file as standard input" in one_error_line(result)
    assert verified_wist.read_bytes() == before


def test_challenge_and_corpus_fetch_refuse_their_input_as_output(tmp_path):
    documents = tmp_path / "docs.jsonl"
    shutil.copy(FIXTURES / "documents.jsonl", documents)
    before = documents.read_bytes()
    result = run_sptool("challenge", "--from", "documents", str(documents), "--backend", "scripted",
                        "-o", str(documents))
    assert "same file as the input" in one_error_line(result)
    paths = tmp_path / "paths.jsonl"
    shutil.copy(FIXTURES / "paths.jsonl", paths)
    result = run_sptool("corpus", "fetch", str(paths), "--search", "local:package:web",
                        "--encoder", "none", "-o", str(paths))
    assert "same file as the input" in one_error_line(result)
    assert documents.read_bytes() == before and paths.read_bytes() == (FIXTURES / "paths.jsonl").read_bytes()


def test_output_onto_a_fifo_or_a_device_is_refused_and_left_as_it_was(verified_wist, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target in (fifo, "/dev/full", tmp_path):
        result = run_sptool("filter", "--recipe", "wist", str(verified_wist), "-o", str(target))
        line = one_error_line(result)
        assert "refusing to replace it" in line, line
    assert os.path.exists(fifo) and not os.path.isfile(fifo)  # still a FIFO
    import stat
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_output_through_a_symlink_replaces_the_file_and_keeps_the_link(verified_wist, tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    result = run_sptool("filter", "--recipe", "wist", "-q", str(verified_wist), "-o", str(link))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert read_jsonl(real) and read_jsonl(real)[0]["role"] in ("challenger", "solver")


def test_dev_null_and_dev_stdout_are_written_through(verified_wist):
    result = run_sptool("filter", "--recipe", "wist", "-q", str(verified_wist), "-o", "/dev/null")
    assert result.returncode == 0 and result.stdout == "", result.stderr
    result = run_sptool("filter", "--recipe", "wist", "-q", str(verified_wist), "-o", "/dev/stdout")
    assert result.returncode == 0, result.stderr
    assert read_jsonl(result.stdout)


def test_a_failure_before_commit_leaves_no_output(tmp_path):
    """posterior update saves the tree in run_stage's before_commit: when that fails, -o and
    --rejects keep their old content (the old order wrote -o, then failed saving the tree)."""
    from sptool.cli.common import run_stage
    from sptool.core.records import RuntimeFailure
    from sptool.core.stage import Stage

    class Echo(Stage):
        name = "echo"

        def process(self, records):
            yield from records

    source = write_jsonl(tmp_path / "in.jsonl", [{"a": 1}, {"a": 2}])
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")

    def fail():
        raise RuntimeFailure("cannot save the tree")

    with pytest.raises(RuntimeFailure):
        run_stage(Echo(), input_path=str(source), output=str(out), quiet=True, before_commit=fail)
    assert out.read_text() == "previous\n"
    assert not list(tmp_path.glob(".sptool-*"))
    run_stage(Echo(), input_path=str(source), output=str(out), quiet=True, before_commit=lambda: None)
    assert read_jsonl(out) == [{"a": 1}, {"a": 2}]


# ---------------------------------------------------------------- 2. silent corruption

def wist_records() -> list[dict]:
    return read_jsonl(FIXTURES / "verified_wist.jsonl")


@pytest.mark.parametrize("mutate, expected", [
    (lambda r: r["samples"][0].update(correct="false"), "field 'samples[0].correct': expected true/false, got the string \"false\""),
    (lambda r: r.update(valid="no"), "field 'valid': expected true/false, got the string \"no\""),
    (lambda r: r.update(p_hat=1.5), "field 'p_hat': expected a number in [0, 1], got 1.5"),
    (lambda r: r.update(var="0.25"), "field 'var': expected a number in [0, 1] or null"),
])
def test_mistyped_fields_are_refused_with_source_line(tmp_path, mutate, expected):
    """"correct": "false" used to count as correct in filter, "valid": "no" as valid (exit 0)."""
    records = wist_records()
    mutate(records[1])
    path = write_jsonl(tmp_path / "v.jsonl", records)
    result = run_sptool("filter", "--recipe", "wist", str(path), "-o", str(tmp_path / "g.jsonl"))
    line = one_error_line(result)
    assert f"{path}:2: {expected}" in line, line
    assert not (tmp_path / "g.jsonl").exists()


@pytest.mark.parametrize("text, expected", [
    ('{"question": "q", "answer": NaN}', "NaN is not a JSON number"),
    ('{"question": "q", "answer": -Infinity}', "-Infinity is not a JSON number"),
    ('{"question": "q", "answer": 1e999}', "the number 1e999 is too large"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_non_finite_numbers_and_deep_nesting_are_refused_at_read_time(text, expected):
    result = run_sptool("solve", "--backend", "scripted", input='{"question": "fine"}\n' + text + "\n")
    line = one_error_line(result)
    assert "<stdin>:2:" in line and expected in line, line
    assert result.stdout == ""


@pytest.mark.parametrize("args, expected", [
    (["train-step", "--lr", "inf", "-o", "{tmp}/ckpt"], "--lr/--learning-rate must be a finite number, got inf"),
    (["train-step", "--lr", "-1", "-o", "{tmp}/ckpt"], "--lr/--learning-rate must be in (0, 1], got -1.0"),
    (["verify", "--deadline", "inf"], "--deadline must be a finite number, got inf"),
    (["verify", "--deadline", "-1"], "--deadline must be in (0, 604800], got -1.0"),
    (["solve", "--deadline", "nan", "--backend", "scripted"], "--deadline must be a finite number, got nan"),
    (["corpus", "fetch", "--retries", "-1"], "--retries must be in [0, 100], got -1"),
    (["corpus", "fetch", "--timeout", "nan"], "--timeout must be a finite number, got nan"),
    (["tree", "expand", "--tree", "{tmp}/t.json", "--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    (["solve", "-k", "100000000000000000000000", "--backend", "scripted"],
     "-k/--samples must be in [1, 4096], got 100000000000000000000000 (generations per question)"),
    (["tree", "expand", "--tree", "{tmp}/t.json", "--paths", "10000000"], "-b/--paths must be in [1, 100000], got 10000000"),
    (["solve", "--temperature", "nan", "--backend", "scripted"], "--temperature must be a finite number"),
])
def test_bad_option_values_are_refused_before_any_work(tmp_path, args, expected):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run_sptool(*args, input='{"question": "q"}\n')
    line = one_error_line(result)
    assert expected in line, line
    assert result.stdout == "" and not (tmp_path / "ckpt").exists()


@pytest.fixture(scope="module")
def nan_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A small random Llama with one NaN weight (as an earlier broken update would leave it)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    path = tmp_path_factory.mktemp("nan-llama") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_train_step_never_writes_a_checkpoint_with_non_finite_weights(nan_model_dir, tmp_path):
    out = tmp_path / "step-1"
    result = run_sptool("train-step", "-m", nan_model_dir, "-o", str(out), "--device", "cpu", input="")
    line = one_error_line(result, code=1) if result.stderr.count("\n") <= 1 else result.stderr.splitlines()[-1]
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "non-finite" in line and "not written" in line, result.stderr
    assert not out.exists()


# ---------------------------------------------------------------- 3. deadlines that hold

@pytest.mark.slow
def test_solve_deadline_cuts_generation_writes_what_is_solved_and_exits_1(tmp_path):
    """`solve` had no deadline at all; --deadline is a total budget (model loading included)."""
    import time

    out, rejects = tmp_path / "solved.jsonl", tmp_path / "rejects.jsonl"
    questions = [{"question": f"Compute {i} + {i}, explaining every step in detail."} for i in range(12)]
    source = write_jsonl(tmp_path / "q.jsonl", questions)
    started = time.monotonic()
    result = run_sptool("solve", str(source), "-k", "4", "--max-tokens", "2048", "--questions-per-call", "2",
                        "--temperature", "1.0", "--device", "cpu", "--deadline", "20",
                        "-o", str(out), "--rejects", str(rejects), "-q")
    elapsed = time.monotonic() - started
    line = one_error_line(result, code=1)
    assert "--deadline 20s reached" in line, line
    # + interpreter start-up, and model loading, which cannot be interrupted, on a loaded machine
    assert elapsed < 20 + 15, elapsed
    solved, dropped = read_jsonl(out), read_jsonl(rejects)
    assert len(solved) + len(dropped) == 12 and dropped
    assert all(r["reject_reason"] == "deadline" for r in dropped)
    assert all(len(r["samples"]) == 4 for r in solved)


SLOW_SAMPLE = "\\boxed{" + "1+" * 20000 + "1}"          # math-verify parses this for seconds
NESTED_BOXES = "\\boxed{" * 8000 + "1" + "}" * 8000       # took `verify --deadline 5` 53 s


def slow_to_grade(count: int) -> list[dict]:
    """``count`` samples that each cost math-verify a parse (a sum with a variable, about 2.5 s a
    sample here). `verify` judged 40 copies of the closed sum SLOW_SAMPLE in under 3 s (unevaluated
    arithmetic is no answer), and 40 copies of one open sum in 3 s too (its parsed-answer cache), so
    every sample's answer is distinct."""
    return [{"text": "\\boxed{" + "x+" * 20000 + f"{i + 1}}}"} for i in range(count)]


def test_nested_boxes_and_slow_grading_end_within_the_deadline_plus_a_second():
    import gc
    import time

    from sptool.stages.verify import VerifyStage, extract_final_answer

    def scan_seconds() -> float:
        # this thread's CPU time, not the wall clock: CI's loaded cores once stretched 42 ms to 2.1 s
        started = time.thread_time()
        assert extract_final_answer("\\boxed{" * 30000) is None  # parent side: linear, unclosed
        assert extract_final_answer(NESTED_BOXES) == "1"
        return time.thread_time() - started

    # without the garbage collector: the scan's allocations once set off a full collection of the
    # test worker's heap (models and all) inside the timed lines, 1.76 s of CPU time in CI
    gc.collect()
    gc.disable()
    try:
        fastest = min(scan_seconds() for _ in range(3))
    finally:
        gc.enable()
    assert fastest < 1.0  # linear: 42 ms here; a quadratic scan takes minutes
    stage = VerifyStage(workers=1, deadline_s=2.0)
    try:
        warm = list(stage.run([{"question": "1+1?", "answer": "2", "samples": [{"text": "\\boxed{2}"}]}]))
        assert warm[0]["p_hat"] == 1.0  # the worker is up (imports done outside any deadline)
        for text in (NESTED_BOXES, "\\boxed{" * 8000, SLOW_SAMPLE):
            record = {"question": "q", "answer": "2", "samples": [{"text": text}]}
            started = time.monotonic()
            [graded] = stage.run([record])
            elapsed = time.monotonic() - started
            assert elapsed < 2.0 + 1.0, (text[:20], elapsed)
        assert graded["verify_error"] and "timed out after 2s" in graded["verify_error"]
        assert graded["p_hat"] is None and graded["samples"][0]["correct"] is None
    finally:
        stage.close()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        found += children
        todo += children
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_grading_workers_die_with_a_killed_parent(tmp_path):
    """After `kill -9` of verify, its grading worker used to keep running at full CPU."""
    import signal
    import time

    record = {"question": "q", "answer": "2", "samples": slow_to_grade(40)}
    source = write_jsonl(tmp_path / "slow.jsonl", [record])
    process = subprocess.Popen([*SPTOOL, "verify", "--workers", "1", "--deadline", "600", "-q", str(source)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        # the grading worker: a descendant (a child, or a forkserver's child) alive for 3 s; a helper
        # seen only briefly at start-up under CI load is not one
        deadline = time.monotonic() + 120
        first_seen: dict[int, float] = {}
        workers: list[int] = []
        while time.monotonic() < deadline and not workers and process.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            alive = {pid for pid in _descendants(process.pid) if _alive(pid)}
            first_seen = {pid: first_seen.get(pid, now) for pid in alive}
            workers = [pid for pid, seen in first_seen.items() if now - seen >= 3]
        assert process.poll() is None, "verify ended before its grading could be killed"
        assert workers, "no grading worker alive for 3 s"
        process.send_signal(signal.SIGKILL)
        process.wait()
        gone_by = time.monotonic() + 5
        while time.monotonic() < gone_by and any(_alive(pid) for pid in workers):
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers), "a grading worker outlived its parent"
    finally:
        if process.poll() is None:
            process.kill()


# ---------------------------------------------------------------- 3/4. HTTP: total budget, address policy

class _Hostile:
    """A real HTTP server on 127.0.0.1: /drip sends one byte a second, anything else redirects to
    ``self.target`` (set per test)."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hostile = self
        self.target = ""

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                import time

                if self.path.startswith("/drip") or "drip" in self.path:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "200")
                    self.end_headers()
                    try:
                        for _ in range(200):
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(1.0)
                    except OSError:
                        pass
                    return
                self.send_response(302)
                self.send_header("Location", hostile.target)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class _Listener:
    """A bare TCP listener that counts the connections it receives (the redirect target)."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0

        def accept():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.connections += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                conn.close()

        threading.Thread(target=accept, daemon=True).start()

    def close(self):
        self.sock.close()


@pytest.fixture
def hostile():
    server = _Hostile()
    yield server
    server.close()


@pytest.fixture
def listener():
    target = _Listener()
    yield target
    target.close()


def _clients(base: str, timeout: float, **policy):
    """Every outbound HTTP client of sptool, pointed at ``base``: name -> call()."""
    from sptool.stages.corpus.fetch import Fetcher
    from sptool.stages.corpus.policy import UrlPolicy
    from sptool.stages.corpus.search import BraveSearch, SearxngSearch, WikipediaSearch
    from sptool.stages.tree.title_sources import WikipediaTitles

    os.environ.setdefault("SPTOOL_BRAVE_API_KEY", "test-key")
    return {
        "corpus fetch": lambda: Fetcher(UrlPolicy(allow_networks=["127.0.0.1/32"], **policy), timeout=timeout,
                                        retries=0, per_host_delay=0).fetch(base + "/page"),
        "searxng": lambda: SearxngSearch(base, timeout=timeout, **policy).search("q", 5),
        "wikipedia search": lambda: WikipediaSearch(base + "/w/api.php", timeout=timeout, **policy).search("q", 5),
        "brave": lambda: BraveSearch(base + "/res", timeout=timeout, **policy).search("q", 5),
        "titles": lambda: WikipediaTitles(base + "/w/api.php", timeout_s=timeout, retries=0, **policy).search("q"),
    }


def _outcome(call) -> str:
    result = None
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 - SearchError / RuntimeFailure: the message
        return str(error)
    return f"{result.error}: {result.detail}" if getattr(result, "error", None) else f"ok {result!r}"


def test_a_server_sending_one_byte_a_second_is_cut_at_the_total_budget(hostile):
    """Per-read timeouts let a drip feed last 200 s (101 s in the review); the budget is total."""
    import time

    for name, call in _clients(hostile.base + "/drip", 3.0).items():
        started = time.monotonic()
        outcome = _outcome(call)
        elapsed = time.monotonic() - started
        assert "timeout" in outcome and "within 3s" in outcome, (name, outcome)
        assert 2.5 < elapsed < 3.0 + 1.5, (name, elapsed)


@pytest.mark.parametrize("where", ["http://2130706433:{port}/x", "http://0177.0.0.1:{port}/x",
                                   "http://localhost:{port}/x", "http://[::ffff:127.0.0.1]:{port}/x",
                                   "ftp://127.0.0.1:{port}/x", "http://169.254.169.254/latest/meta-data/"])
def test_redirects_to_loopback_private_metadata_or_ftp_are_refused_before_connecting(hostile, listener, where):
    """The search and title clients followed these redirects (once to cloud metadata)."""
    hostile.target = where.format(port=listener.port)
    for name, call in _clients(hostile.base, 5.0).items():
        if name == "corpus fetch":  # reaches 127.0.0.1 only through --allow-network (test_corpus covers it)
            continue
        outcome = _outcome(call)
        assert "redirect to" in outcome and ("private-address" in outcome or "scheme" in outcome), (name, outcome)
    assert listener.connections == 0  # refused before any connection was made


def test_allow_private_lets_a_redirect_reach_loopback_but_never_metadata(hostile, listener):
    hostile.target = f"http://localhost:{listener.port}/x"
    clients = _clients(hostile.base, 5.0, allow_private=True)
    for name in ("searxng", "titles"):
        assert "private-address" not in _outcome(clients[name]), name
    assert listener.connections == 2  # both redirects were followed to the loopback listener
    hostile.target = "http://169.254.169.254/latest/meta-data/"
    for name, call in _clients(hostile.base, 5.0, allow_private=True).items():
        if name != "corpus fetch":
            assert "link-local/metadata" in _outcome(call), name


# ---------------------------------------------------------------- 5. one line for environment failures

def test_directory_input_and_directory_output_are_one_line(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [SOLVED])
    line = one_error_line(run_sptool("verify", "--workers", "0", str(tmp_path)))
    assert f"{tmp_path}: is a directory" in line
    line = one_error_line(run_sptool("verify", "--workers", "0", str(source), "-o", str(tmp_path)))
    assert "is a directory; refusing to replace it" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes regardless of permissions")
def test_unreadable_input_and_read_only_output_directory_are_one_line(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [SOLVED])
    source.chmod(0)
    assert "cannot open (Permission denied)" in one_error_line(run_sptool("verify", "--workers", "0", str(source)))
    source.chmod(0o644)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    line = one_error_line(run_sptool("verify", "--workers", "0", str(source), "-o", str(locked / "out.jsonl")))
    assert "is not writable" in line


def test_corrupt_and_truncated_gz_inputs_name_the_file(tmp_path):
    import gzip

    fake = tmp_path / "fake.jsonl.gz"
    fake.write_text(json.dumps(SOLVED) + "\n")
    truncated = tmp_path / "cut.jsonl.gz"
    whole = gzip.compress("".join(json.dumps(dict(SOLVED, id=f"s{i}")) + "\n" for i in range(2000)).encode())
    truncated.write_bytes(whole[:len(whole) // 2])  # a download cut in the middle
    for path in (fake, truncated):
        line = one_error_line(run_sptool("verify", "--workers", "0", str(path)))
        assert str(path) in line, line
        assert "Aborted" not in line


def test_eval_on_an_empty_file_and_two_benchmarks_with_one_file_name(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = run_sptool("eval", str(empty), "--backend", "scripted", "-k", "1", "--pass-at", "1")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "empty" in result.stdout and " 0 " in result.stdout  # a table row with 0 problems
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_jsonl(tmp_path / "a" / "bench.jsonl", [{"question": "1+1?", "answer": "2"}])
    b = write_jsonl(tmp_path / "b" / "bench.jsonl", [{"question": "2+2?", "answer": "4"}] * 2)
    result = run_sptool("eval", str(a), str(b), "--backend", "scripted", "-k", "1", "--pass-at", "1",
                        "--workers", "0", "--json", "-q")
    assert result.returncode == 0, result.stderr
    benchmarks = json.loads(result.stdout)["benchmarks"]
    assert [(x["name"], x["problems"]) for x in benchmarks] == [(str(a), 1), (str(b), 2)]


def test_a_full_disk_is_one_line_exit_1_and_leaves_nothing_behind(tmp_path):
    """ENOSPC: a real full file system (a 64 KiB tmpfs) where mounting is allowed; the handler
    with a real ENOSPC from /dev/full everywhere."""
    from sptool.cli.main import describe_os_error

    try:
        with open("/dev/full", "w") as handle:
            handle.write("x")
            handle.flush()
    except OSError as error:
        text = describe_os_error(error)
        assert "No space left on device" in text and "disk is full" in text
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (not root); the handler was checked above")
    try:
        big = dict(SOLVED, padding="x" * 4000)
        source = write_jsonl(tmp_path / "in.jsonl", [dict(big, id=f"s{i}") for i in range(60)])
        out = mount / "out.jsonl"
        result = run_sptool("verify", "--workers", "0", "-q", str(source), "-o", str(out))
        line = one_error_line(result, code=1)
        assert "No space left on device" in line, line
        assert not out.exists() and not list(mount.glob(".sptool-*"))
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_at_checkpoint_save_is_an_enospc_error_not_a_writer_traceback(tmp_path):
    """torch.save and safetensors do not raise OSError on a full disk (torch: "unexpected pos …",
    safetensors: an I/O error of its Rust writer); a checkpoint save turns both into ENOSPC, so
    the CLI prints its one line, and leaves no staging directory behind (found when a run filled
    this machine's disk)."""
    import torch
    from safetensors.torch import save_file

    from sptool.cli.main import describe_os_error
    from sptool.train.checkpoint import save_checkpoint

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    big = {"w": torch.zeros(1 << 18)}  # 1 MiB
    try:
        writers = {"safetensors": lambda target: save_file(big, f"{target}/model.safetensors"),
                   "torch.save": lambda target: None}
        for name, save_model in writers.items():
            optimizer = big if name == "torch.save" else None
            with pytest.raises(OSError) as caught:
                save_checkpoint(mount / "step-0001", save_model=save_model, optimizer_state=optimizer,
                                state={"step": 1})
            line = describe_os_error(caught.value)
            assert "No space left on device" in line and "disk is full" in line, (name, line)
            assert str(mount / "step-0001") in line
            assert list(mount.iterdir()) == [], name  # the staging directory is gone
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _slow_verify(tmp_path, out):
    record = {"question": "q", "answer": "2", "samples": slow_to_grade(40)}
    source = write_jsonl(tmp_path / "slow.jsonl", [SOLVED] * 3 + [record])
    return subprocess.Popen([*SPTOOL, "verify", "--workers", "1", "--deadline", "600", "-q", str(source),
                             "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _wait_for_temp(directory, process, seconds=120):
    import time

    until = time.monotonic() + seconds
    while time.monotonic() < until and process.poll() is None:
        temps = list(directory.glob(".sptool-*.part"))
        if temps:
            return temps
        time.sleep(0.2)
    raise AssertionError("no temporary output file appeared")


def test_sigterm_removes_the_temporary_output_and_stops_the_workers(tmp_path):
    import signal

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    process = _slow_verify(tmp_path, out_dir / "graded.jsonl")
    try:
        _wait_for_temp(out_dir, process)
        workers = _children(process.pid)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, stderr
    assert "Traceback" not in stderr and "terminated" in stderr
    assert not list(out_dir.iterdir())  # no temp file, no half output
    import time
    time.sleep(1.5)
    assert not any(_alive(pid) for pid in workers)


def test_temp_files_of_a_killed_run_are_removed_at_the_next_start(tmp_path):
    import signal

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    process = _slow_verify(tmp_path, out_dir / "graded.jsonl")
    try:
        [stale] = _wait_for_temp(out_dir, process)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert stale.exists()  # SIGKILL runs no cleanup
    legacy_live = out_dir / ".sptool-not-ours.part"  # no pid in the name and recent: kept
    legacy_live.write_text("")
    source = write_jsonl(tmp_path / "in.jsonl", [SOLVED])
    result = run_sptool("verify", "--workers", "0", "-q", str(source), "-o", str(out_dir / "next.jsonl"))
    assert result.returncode == 0, result.stderr
    assert not stale.exists() and legacy_live.exists()
    assert read_jsonl(out_dir / "next.jsonl")[0]["p_hat"] == 0.5


# ---------------------------------------------------------------- 6. run directories

from test_run import ENV as RUN_ENV, scripted_args  # noqa: E402


@pytest.mark.slow
def test_kill_after_a_new_checkpoint_before_the_manifest_resumes(tmp_path, random_policy):
    """--keep 1 used to prune the old checkpoint before the manifest named the new one: a kill in
    between left "model directory …/step-0001 does not exist" on every --resume."""
    run_dir = tmp_path / "run"
    args = scripted_args("svs", run_dir, random_policy, "--set", "run.checkpoint_every=1",
                         "--set", "train.lora_r=4")  # LoRA: the checkpoint is written before going on
    result = run_sptool(*args, env={**RUN_ENV, "SPTOOL_TEST_KILL_AT": "2/train:save"})
    assert result.returncode == -signal_number("SIGKILL"), result.stderr
    assert (run_dir / "ckpt" / "policy" / "step-0001").is_dir()  # still named by the manifest
    result = run_sptool(*args, "--resume", env=RUN_ENV)
    assert result.returncode == 0, result.stderr
    steps = sorted(p.name for p in (run_dir / "ckpt" / "policy").iterdir())
    assert steps == ["step-0002"]  # pruned once the manifest named step-0002


def signal_number(name: str) -> int:
    import signal

    return int(getattr(signal, name))


def _prepared_run_dir(tmp_path):
    import gc

    from sptool.recipes import load_config
    from sptool.recipes import build_run

    run_dir = tmp_path / "run"
    driver = build_run(load_config("svs", tiny=True), run_dir)
    driver._prepare_dir()
    from sptool.run import run_dir as module

    module._HELD.pop(os.path.realpath(run_dir)).close()  # as if that process had ended
    del driver
    gc.collect()
    return run_dir


def test_a_run_directory_in_use_is_refused_with_one_line(tmp_path):
    import fcntl

    run_dir = _prepared_run_dir(tmp_path)
    with open(run_dir / ".lock", "w") as held:  # another live `sptool run` holds the directory
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        result = run_sptool("run", "--recipe", "svs", "--tiny", "--run-dir", str(run_dir), "--resume")
        line = one_error_line(result)
        assert "in use by another sptool run (pid 4242)" in line
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["order"] == []  # nothing was touched


def test_corrupt_run_state_is_one_line(tmp_path):
    run_dir = _prepared_run_dir(tmp_path)
    (run_dir / "manifest.json").write_text('{"format": 1, "stages": {')
    result = run_sptool("run", "--recipe", "svs", "--tiny", "--run-dir", str(run_dir), "--resume")
    assert "manifest.json is corrupt" in one_error_line(result, code=1)
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    result = run_sptool("run", "--recipe", "svs", "--tiny", "--run-dir", str(a_file))
    assert "is a file, not a directory" in one_error_line(result)
    (run_dir / "metrics.jsonl").write_text('{"iteration": 1, "stage": "solve"}\n{"iteration": 2, "sta\n')
    (run_dir / "manifest.json").write_text('{"format": 1, "stages": {}, "order": []}')
    result = run_sptool("report", str(run_dir))
    assert f"{run_dir / 'metrics.jsonl'}:2: not valid JSON" in one_error_line(result)


def test_a_corrupt_pool_file_is_one_line(tmp_path):
    from sptool.stages.corpus.pool import LeafPool

    pool = tmp_path / "pool"
    LeafPool(pool).path_for("Pythagorean theorem").write_text('{"url": "http://a", "text": "ok"}\n{"url": \n')
    paths = tmp_path / "paths.jsonl"
    shutil.copy(FIXTURES / "paths.jsonl", paths)
    result = run_sptool("corpus", "fetch", str(paths), "--search", "local:package:web", "--encoder", "none",
                        "--pool", str(pool))
    line = one_error_line(result)
    assert ".jsonl:2: not valid JSON" in line and str(pool) in line


@pytest.mark.parametrize("setting, expected", [
    ("verify.deadline_s=-1", "key 'verify.deadline_s': must be in (0, 604800], got -1"),
    ("train.learning_rate=-1", "key 'train.learning_rate': must be in (0, 1], got -1"),
    ("train.learning_rate=inf", "key 'train.learning_rate': must be a finite number, got inf"),
])
def test_run_refuses_bad_config_values_before_any_work(tmp_path, setting, expected):
    """verify.deadline_s=-1 graded nothing, trained nothing and exited 0; learning_rate=-1 was
    refused only at the first train stage."""
    run_dir = tmp_path / "run"
    result = run_sptool("run", "--recipe", "svs", "--tiny", "--run-dir", str(run_dir), "--set", setting)
    assert expected in one_error_line(result)
    assert not run_dir.exists()
