"""URL policy F_url (WIST §3.3): which URLs may be fetched at all.

Two layers, both applied to the first URL *and to every redirect hop*:

1. :meth:`UrlPolicy.check_url` — scheme, allow/deny lists by domain and by regular expression.
   The defaults deny benchmark and solution sites (leakage) and the WIST reference's noise list
   (arxiv, academia.edu, github, youtube, talk pages, PDFs). An allow entry wins over a deny
   entry, so ``--allow-domain github.com`` re-enables a default-denied site.
2. :meth:`UrlPolicy.check_addresses` — after DNS resolution, refuse private, loopback,
   link-local, multicast, reserved and cloud-metadata addresses (anything that is not a global
   unicast address) unless explicitly allowed. ``allow_private`` allows loopback and private
   networks but never link-local/metadata addresses; ``allow_networks`` allows exactly the given
   CIDR blocks (tests use ``127.0.0.1/32``). The fetcher connects to the very address that was
   checked, so a DNS answer cannot change between the check and the connection.

A policy file holds one rule per line (``#`` starts a comment)::

    deny: example.com            # the domain and its subdomains
    allow: github.com            # wins over a deny (also over the defaults)
    deny-pattern: /forum/        # a Python regular expression searched in the full URL
    allow-pattern: ^https://en\\.wikipedia\\.org/wiki/[^:]+$
    no-defaults                  # drop the built-in deny lists
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlsplit

from sptool.core.records import InputError, UsageError

#: Benchmark and solution sites (leakage) and the WIST reference's noise domains.
DEFAULT_DENY_DOMAINS: tuple[str, ...] = (
    # leakage: competition solutions, benchmark datasets and leaderboards
    "artofproblemsolving.com", "paperswithcode.com", "kaggle.com", "chegg.com", "coursehero.com",
    "brainly.com", "openreview.net",
    # the reference's noise list
    "arxiv.org", "academia.edu", "github.com", "githubusercontent.com", "gist.github.com",
    "youtube.com", "youtu.be", "researchgate.net",
)

#: Regular expressions searched in the full URL (case-insensitive).
DEFAULT_DENY_PATTERNS: tuple[str, ...] = (
    r"^https?://(www\.)?huggingface\.co/datasets(/|$)",   # benchmark datasets
    r"/wiki/([^/?#]*_)?talk:",                            # MediaWiki talk pages (Talk:, User_talk:, …)
    r"[?&]title=([^&]*_)?talk:",
    r"\.pdf($|[?#])",                                     # PDFs
)

#: Host names of cloud metadata services (their addresses are link-local anyway).
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "instance-data",
                            "metadata.azure.com"})

#: Addresses of cloud metadata services that are not link-local (AWS's IPv6 one is in fd00::/8,
#: Alibaba's in 100.64.0.0/10): refused like link-local ones, never allowed by ``allow_private``.
METADATA_ADDRESSES = frozenset({"fd00:ec2::254", "100.100.100.200"})

ALLOWED_SCHEMES = ("http", "https")


@dataclass(frozen=True)
class Refusal:
    """Why a URL is refused: a short category (counted in summaries) and the details."""

    category: str
    detail: str

    def __str__(self) -> str:
        return f"{self.category}: {self.detail}"


def host_matches(host: str, domain: str) -> bool:
    """True when ``host`` is ``domain`` or one of its subdomains (``a.b.org`` matches ``b.org``)."""
    host, domain = host.lower().rstrip("."), domain.lower().strip().lstrip(".").rstrip(".")
    return host == domain or host.endswith("." + domain)


def address_problem(address: str) -> str | None:
    """Why an IP address must not be fetched ('loopback', 'private', …) or None when global."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local or str(ip) in METADATA_ADDRESSES:
        return "link-local/metadata"
    if ip.is_multicast:
        return "multicast"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_private:
        return "private"
    if ip.is_reserved or not ip.is_global:
        return "reserved"
    return None


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for info in infos:
        address = info[4][0]
        if address not in seen:
            seen.append(address)
    return seen


@dataclass
class UrlPolicy:
    """Allow/deny lists plus the network rule; see the module docstring."""

    deny_domains: list[str] = field(default_factory=lambda: list(DEFAULT_DENY_DOMAINS))
    allow_domains: list[str] = field(default_factory=list)
    deny_patterns: list[str] = field(default_factory=lambda: list(DEFAULT_DENY_PATTERNS))
    allow_patterns: list[str] = field(default_factory=list)
    schemes: tuple[str, ...] = ALLOWED_SCHEMES
    allow_private: bool = False
    allow_networks: list[str] = field(default_factory=list)
    resolver: Callable[[str, int], list[str]] = _resolve

    def __post_init__(self) -> None:
        try:
            self._deny_re = [re.compile(p, re.IGNORECASE) for p in self.deny_patterns]
            self._allow_re = [re.compile(p, re.IGNORECASE) for p in self.allow_patterns]
        except re.error as exc:
            raise UsageError(f"bad URL pattern in policy: {exc}") from None
        try:
            self._networks = [ipaddress.ip_network(n, strict=False) for n in self.allow_networks]
        except ValueError as exc:
            raise UsageError(f"--allow-network: {exc}") from None

    # ---- layer 1: the URL text ---------------------------------------------------------------
    def check_url(self, url: str) -> Refusal | None:
        """Refusal for a URL's scheme, domain or pattern, or None when it may be fetched."""
        try:
            parts = urlsplit(url)
            host = parts.hostname or ""
            parts.port  # raises ValueError on a bad port
        except ValueError as exc:
            return Refusal("bad-url", f"{url!r}: {exc}")
        if parts.scheme.lower() not in self.schemes:
            return Refusal("scheme", f"scheme {parts.scheme or '(none)'!r} not in {list(self.schemes)}")
        if not host:
            return Refusal("bad-url", f"no host in {url!r}")
        if any(p.search(url) for p in self._allow_re):
            return None
        if any(host_matches(host, d) for d in self.allow_domains):
            return None
        for domain in self.deny_domains:
            if host_matches(host, domain):
                return Refusal("denied-domain", f"{host} is on the deny list ({domain})")
        for pattern in self._deny_re:
            if pattern.search(url):
                return Refusal("denied-pattern", f"URL matches deny pattern {pattern.pattern!r}")
        if host.lower().rstrip(".") in METADATA_HOSTS:
            return Refusal("private-address", f"{host} is a cloud metadata host")
        return None

    # ---- layer 2: the addresses the host resolves to -----------------------------------------
    def address_allowed(self, address: str) -> str | None:
        """Why ``address`` is refused, or None when it may be connected to."""
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if any(ip in network for network in self._networks):
            return None
        problem = address_problem(address)
        if problem is None:
            return None
        if self.allow_private and problem in ("loopback", "private"):
            return None
        return problem

    def check_addresses(self, host: str, port: int) -> tuple[list[str], Refusal | None]:
        """Resolve ``host`` and check every address; returns (addresses, refusal or None).

        All resolved addresses must be allowed (a host that resolves to one public and one
        private address is refused), so the caller may connect to any of them.
        """
        try:
            addresses = self.resolver(host, port)
        except (socket.gaierror, UnicodeError, OSError) as exc:
            return [], Refusal("dns-error", f"cannot resolve {host}: {exc}")
        if not addresses:
            return [], Refusal("dns-error", f"{host} resolves to no address")
        for address in addresses:
            problem = self.address_allowed(address)
            if problem:
                hint = "" if problem.startswith("link-local") else " (use --allow-private to allow)"
                return addresses, Refusal("private-address",
                                          f"{host} resolves to {address} ({problem}){hint}")
        return addresses, None


def parse_policy_lines(lines: Iterable[str], *, source: str = "<policy>") -> dict:
    """Parse policy rules (see the module docstring) into keyword arguments for UrlPolicy."""
    rules: dict[str, list[str]] = {"deny": [], "allow": [], "deny-pattern": [], "allow-pattern": []}
    defaults = True
    for number, raw in enumerate(lines, start=1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line == "no-defaults":
            defaults = False
            continue
        key, sep, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if not sep or key not in rules or not value:
            raise InputError(f"expected 'deny: DOMAIN', 'allow: DOMAIN', 'deny-pattern: REGEX', "
                             f"'allow-pattern: REGEX' or 'no-defaults', got {line!r}",
                             source=source, line=number)
        if key.endswith("pattern"):
            try:
                re.compile(value)
            except re.error as exc:
                raise InputError(f"bad regular expression ({exc})", source=source, line=number) from None
        rules[key].append(value)
    return {
        "deny_domains": (list(DEFAULT_DENY_DOMAINS) if defaults else []) + rules["deny"],
        "allow_domains": rules["allow"],
        "deny_patterns": (list(DEFAULT_DENY_PATTERNS) if defaults else []) + rules["deny-pattern"],
        "allow_patterns": rules["allow-pattern"],
    }


def load_policy(path: str | None = None, *, allow_domains: Iterable[str] = (),
                deny_domains: Iterable[str] = (), allow_private: bool = False,
                allow_networks: Iterable[str] = ()) -> UrlPolicy:
    """The effective policy: defaults, then the file's rules, then command-line additions."""
    kwargs = {"deny_domains": list(DEFAULT_DENY_DOMAINS), "allow_domains": [],
              "deny_patterns": list(DEFAULT_DENY_PATTERNS), "allow_patterns": []}
    if path:
        file = Path(path)
        if not file.is_file():
            raise InputError("no such policy file", source=str(path))
        from sptool.core.jsonl import read_text_file

        kwargs = parse_policy_lines(read_text_file(file, what="policy").splitlines(), source=str(path))
    kwargs["allow_domains"] += list(allow_domains)
    kwargs["deny_domains"] += list(deny_domains)
    return UrlPolicy(**kwargs, allow_private=allow_private, allow_networks=list(allow_networks))


def _literal_addresses(host: str) -> list[str] | None:
    """The address a host name spells (``169.254.169.254``, ``[fd00:ec2::254]``, ``2852039166``,
    ``0xa9.0xfe.0xa9.0xfe``), or None when it is a name to resolve."""
    try:
        return [str(ipaddress.ip_address(host.strip("[]").split("%", 1)[0]))]
    except ValueError:
        pass
    try:
        return [socket.inet_ntoa(socket.inet_aton(host))]  # the C library's spellings of IPv4
    except (OSError, UnicodeError, ValueError):
        return None


def check_endpoint(url: str, *, setting: str, allow_networks: Iterable[str] = (),
                   allow_hint: str = "--allow-network CIDR",
                   resolver: Callable[[str, int], list[str]] = _resolve) -> None:
    """Refuse (one :class:`UsageError` naming ``setting``) a configured endpoint (a search, wiki
    or title API) on a link-local or cloud-metadata address, unless ``allow_networks`` holds it
    explicitly. Configured endpoints may be loopback or private (a local SearXNG); the metadata
    service never implicitly: a recipe file from someone else must not point a run at it."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return  # the client reports a malformed URL itself
    if not host:
        return
    networks = [ipaddress.ip_network(n, strict=False) for n in allow_networks]
    if host in METADATA_HOSTS:
        raise UsageError(f"{setting} {url}: {host} is a cloud metadata host; refusing a configured "
                         f"endpoint there")
    addresses = _literal_addresses(host)
    if addresses is None:
        try:
            addresses = resolver(host, port)
        except (OSError, UnicodeError):
            return  # unresolvable now: the request fails later, and is checked again then
    for address in addresses:
        if address_problem(address) != "link-local/metadata":
            continue
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if any(ip in network for network in networks):
            continue
        raise UsageError(f"{setting} {url}: {host} is a link-local/metadata address ({address}); "
                         f"refusing a configured endpoint there (allow it explicitly with {allow_hint})")


def network_policy(*, allow_private: bool = False, allow_networks: Iterable[str] = ()) -> UrlPolicy:
    """The address rule alone (no domain or pattern lists): for API clients (search endpoints,
    title lookups) whose redirects must not reach loopback, private or metadata addresses."""
    return UrlPolicy(deny_domains=[], deny_patterns=[], allow_private=allow_private,
                     allow_networks=list(allow_networks))
