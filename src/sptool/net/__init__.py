"""Outbound HTTP: every request sptool makes to the network goes through here (``http``: address
policy, redirects, size and time limits; ``mediawiki``: the one MediaWiki client, over ``http``)."""

from sptool.net.http import HttpClient, HttpError, Response, parse_content_type

__all__ = ["HttpClient", "HttpError", "Response", "parse_content_type"]
