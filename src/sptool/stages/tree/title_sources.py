"""Title-search backends for validating new tree nodes (WIST §3.2, eq. 9).

A title backend answers ``search(query, limit) -> list[str]``: the titles of encyclopedia
articles that a search for ``query`` returns. The tree expander computes
``s_max = max_w sim_str(label, w)`` over those titles and accepts a non-leaf node when
``s_max >= tau_wiki``.

Two backends:

- :class:`WikipediaTitles`: MediaWiki's public search API (``action=query&list=search``, or
  ``action=opensearch``) through the one MediaWiki client, :mod:`sptool.net.mediawiki` (total
  time budget; redirects away from the endpoint checked by the address policy before
  connecting). The endpoint is configurable (``--wiki-url``), so a mirror or a local test server
  can stand in.
- :class:`LocalTitles`: an offline list of titles (a text file, one title per line, ``#``
  comments) or a folder (every file name, ``Group_theory.txt`` → "Group theory"). Search ranks
  the titles by token-set similarity to the query, like a search engine would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from sptool.core.records import InputError, RuntimeFailure, UsageError

USER_AGENT = "sptool/0.1 (self-play RLVR toolkit; title validation)"


class TitleBackend(Protocol):
    """What a title-search backend provides."""

    name: str

    def search(self, query: str, limit: int = 10) -> list[str]:
        """Titles returned for ``query`` (best first, at most ``limit``)."""
        ...


class WikipediaTitles:
    """MediaWiki search (:class:`sptool.net.mediawiki.MediaWiki`): ``list=search`` (default) or
    ``opensearch``."""

    name = "wikipedia"

    def __init__(self, url: str | None = None, *, api: str = "search", timeout_s: float = 10.0,
                 retries: int = 1, allow_private: bool = False, allow_networks=()):
        if api not in ("search", "opensearch"):
            raise UsageError(f"unknown Wikipedia API '{api}'; choose from search, opensearch")
        from sptool.net.mediawiki import MediaWiki
        from sptool.stages.corpus.policy import network_policy

        # The configured endpoint is trusted at its own origin; a redirect elsewhere is checked
        # (loopback, private, metadata refused unless allow_private) before any connection, and
        # each search has a total time budget of timeout_s (retries included).
        self.wiki = MediaWiki(url, policy=network_policy(allow_private=allow_private,
                                                         allow_networks=allow_networks),
                              timeout=timeout_s, retries=retries, backoff=0.2, max_bytes=2_000_000,
                              user_agent=USER_AGENT, setting="--wiki-url")
        self.url = self.wiki.url
        self.api = api
        self.timeout_s = timeout_s

    @property
    def requests(self) -> int:
        """HTTP attempts made so far (retries included)."""
        return self.wiki.attempts

    def search(self, query: str, limit: int = 10) -> list[str]:
        from sptool.net.mediawiki import MediaWikiError

        try:
            if self.api == "opensearch":
                return self.wiki.opensearch(query, limit)
            return [hit["title"] for hit in self.wiki.search(query, limit, srprop="")]
        except MediaWikiError as error:
            if error.http is not None:
                raise RuntimeFailure(f"title search at {self.url} failed: {error.detail} (no network? "
                                     "pass --titles FILE, one title a line, to validate new nodes "
                                     "offline)") from None
            separator = ": " if error.category == "shape" else " "
            raise RuntimeFailure(f"title search at {self.url}{separator}{error.detail}") from None


class LocalTitles:
    """Offline titles: a text file (one per line) or a folder (file names are titles)."""

    name = "local"

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.titles = load_titles(self.path)

    def search(self, query: str, limit: int = 10) -> list[str]:
        from rapidfuzz import fuzz, process, utils

        hits = process.extract(query, self.titles, scorer=fuzz.token_set_ratio,
                               processor=utils.default_process, limit=limit, score_cutoff=1)
        return [title for title, _score, _index in hits]


def load_titles(path: str) -> list[str]:
    """Titles from a file (one a line, ``#`` comments) or a folder (file stems, ``_`` → space);
    ``package:NAME`` names one shipped with sptool."""
    from sptool.core.packaged import local_path

    target = Path(local_path(os.fspath(path)))
    if not target.exists():
        raise InputError("no such titles file or folder", source=path)
    titles: list[str] = []
    if target.is_dir():
        for item in sorted(target.rglob("*")):
            if item.is_file() and not item.name.startswith("."):
                titles.append(item.stem.replace("_", " "))
    else:
        try:
            text = target.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError("not valid UTF-8 text, expected one title per line", source=path) from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                titles.append(line)
    if not titles:
        raise InputError("contains no titles", source=path)
    return list(dict.fromkeys(titles))


def load_title_backend(titles: str | None = None, wiki_url: str | None = None, *,
                       api: str = "search", timeout_s: float = 10.0, allow_private: bool = False,
                       allow_networks=(), setting: str = "--wiki-url",
                       allow_hint: str = "--allow-network CIDR") -> TitleBackend:
    """``--titles PATH`` → offline list; otherwise Wikipedia at ``wiki_url`` (default: en.wikipedia)."""
    if titles and wiki_url:
        raise UsageError("give either --titles (offline) or --wiki-url (Wikipedia), not both")
    if titles:
        return LocalTitles(titles)
    if wiki_url:
        from sptool.stages.corpus.policy import check_endpoint

        check_endpoint(wiki_url, setting=setting, allow_networks=allow_networks, allow_hint=allow_hint)
    return WikipediaTitles(wiki_url, api=api, timeout_s=timeout_s,
                           allow_private=allow_private, allow_networks=allow_networks)
