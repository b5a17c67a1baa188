"""Throughput of ``corpus fetch`` against a local HTTP server (pages/s), with and without concurrency.

    python benchmarks/corpus_fetch.py [--pages 64] [--latency-ms 50]

A ThreadingHTTPServer on 127.0.0.1 serves ``--pages`` generated articles (~6 KB of HTML with
navigation and ads), each answer delayed by ``--latency-ms`` to stand in for a remote site.
Two measurements per concurrency level, politeness delay off (one host would otherwise
serialise everything):

- fetch: :class:`sptool.stages.corpus.fetch.Fetcher` alone (policy check, DNS, HTTP, size cap);
- fetch+clean: the whole :class:`CorpusFetchStage` with a fake search backend listing the pages
  (fetch, trafilatura extraction, language/length checks, near-duplicate index), title
  similarity off (``encoder=None``) so the figure is about fetching and cleaning.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sptool.stages.corpus.fetch import Fetcher
from sptool.stages.corpus.policy import UrlPolicy
from sptool.stages.corpus.search import SearchResult
from sptool.stages.corpus.stage import CorpusFetchStage

WORDS = ("triangle hypotenuse square theorem proof angle side length area sum number prime "
         "divisor factor product equation circle radius").split()


def page(i: int) -> bytes:
    rng = random.Random(i)
    body = []
    for p in range(12):
        words = [rng.choice(WORDS) for _ in range(60)]
        body.append(f"<p>Paragraph {p} of article {i}: the " + " and the ".join(words) + ".</p>")
    return (f"<html><head><title>Article {i} about geometry</title></head><body>"
            f"<nav><a href='/'>Home</a> | <a href='/a'>About</a></nav>"
            f"<div class='ad'>Buy now! Offer {i}</div><article><h1>Article {i}</h1>{''.join(body)}"
            f"</article><footer>Copyright 2026</footer></body></html>").encode()


def serve(latency_s: float):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            time.sleep(latency_s)
            index = int(self.path.strip("/").split(".")[0] or 0)
            data = page(index)
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    ThreadingHTTPServer.request_queue_size = 128
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class ListedPages:
    name = "listed"

    def __init__(self, urls):
        self.urls = urls

    def search(self, query, limit):
        return [SearchResult(url=u, title="", rank=i + 1, engine=self.name)
                for i, u in enumerate(self.urls[:limit])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--levels", default="1,4,16")
    args = parser.parse_args()
    server = serve(args.latency_ms / 1000)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    urls = [f"{base}/{i}.html" for i in range(args.pages)]
    policy = UrlPolicy(allow_networks=["127.0.0.1/32"])
    rows = []
    for level in (int(x) for x in args.levels.split(",")):
        fetcher = Fetcher(policy, concurrency=level, per_host_delay=0, retries=0, timeout=10)
        start = time.perf_counter()
        results = list(fetcher.fetch_many(urls))
        fetch_s = time.perf_counter() - start
        assert all(r.ok for r in results), [r.detail for r in results if not r.ok][:3]
        stage = CorpusFetchStage(ListedPages(urls), fetcher, encoder=None, results_per_query=len(urls),
                                 min_chars=200)
        start = time.perf_counter()
        documents = list(stage.run([{"leaf": "geometry"}]))
        stage_s = time.perf_counter() - start
        if len(documents) != args.pages:
            print(f"concurrency {level}: dropped {dict(stage.stats.dropped)}")
        rows.append((level, args.pages / fetch_s, len(documents), args.pages / stage_s))
    server.shutdown()
    print(f"corpus fetch throughput: {args.pages} pages, {args.latency_ms:g} ms server latency, "
          f"127.0.0.1, politeness delay 0")
    print(f"{'concurrency':>11}  {'fetch pages/s':>13}  {'fetch+clean pages/s':>19}  {'kept':>4}")
    for level, fetch_rate, kept, stage_rate in rows:
        print(f"{level:>11}  {fetch_rate:>13.1f}  {stage_rate:>19.1f}  {kept:>4}")


if __name__ == "__main__":
    main()
