"""Configured endpoints are checked too (issue 26, class 4): a ``wist.search_url``/``wiki_url``,
``--search-url`` or ``--wiki-url`` on a link-local or cloud-metadata address is refused before
any work, naming the setting, unless the network is allowed explicitly. Loopback and private
endpoints (a local SearXNG, the tests' servers) stay allowed."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, write_jsonl

METADATA_URLS = ["http://169.254.169.254/", "http://[fd00:ec2::254]/w/api.php",
                 "http://metadata.google.internal/computeMetadata/v1/", "http://2852039166/",
                 "http://0xa9.0xfe.0xa9.0xfe/"]


def one_line(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sptool: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("url", METADATA_URLS)
@pytest.mark.parametrize("key", ["search_url", "wiki_url"])
def test_wist_settings_refuse_metadata_endpoints(cli, key, url):
    error = one_line(cli(["recipes", "show", "wist", "--set", f'wist.{key}="{url}"']))
    assert error.startswith(f"sptool: error: key 'wist.{key}': {url}: ") and "metadata" in error, error


def test_wist_run_refuses_before_any_file_is_written(cli, tmp_path):
    run_dir = tmp_path / "run"
    error = one_line(cli(["run", "--recipe", "wist", "--tiny", "--run-dir", run_dir, "--backend", "scripted",
                          "--set", 'wist.search="searxng"', "--set", 'wist.search_url="http://169.254.169.254/"']))
    assert "key 'wist.search_url'" in error and not run_dir.exists()


def test_an_explicit_allowance_lets_it_through(cli):
    result = cli(["recipes", "show", "wist", "--set", 'wist.search_url="http://169.254.169.254/"',
                  "--set", 'wist.allow_networks="169.254.169.254/32"'])
    assert result.exit_code == 0, result.stderr
    assert cli(["recipes", "show", "wist", "--set", 'wist.search_url="http://127.0.0.1:8080/"']).exit_code == 0


def test_search_url_and_wiki_url_options_refuse_metadata_endpoints(cli, tmp_path):
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"path_id": "p", "path": ["mathematics", "primes"]}])
    error = one_line(cli(["corpus", "fetch", paths, "--search", "searxng", "--search-url",
                          "http://169.254.169.254/", "--encoder", "none"]))
    assert error.startswith("sptool: error: --search-url http://169.254.169.254/: "), error
    error = one_line(cli(["tree", "expand", "--tree", FIXTURES / "tree.json", "--backend", "scripted",
                          "--wiki-url", "http://[fd00:ec2::254]/w/api.php"]))
    assert error.startswith("sptool: error: --wiki-url http://[fd00:ec2::254]/w/api.php: "), error


def test_a_trusted_endpoint_resolving_to_the_metadata_service_is_refused_at_request_time():
    """DNS may change between the check and the request: the client checks the trusted origin too."""
    from sptool.stages.corpus.policy import network_policy
    from sptool.net.http import HttpClient, HttpError

    policy = network_policy()
    policy.resolver = lambda host, port: ["169.254.169.254"]
    client = HttpClient(policy, trusted=["http://search.example/"], retries=0)
    with pytest.raises(HttpError) as caught:
        client.request("http://search.example/search?q=x")
    assert "link-local/metadata" in str(caught.value)


def test_aws_ipv6_metadata_address_is_not_a_private_one():
    from sptool.stages.corpus.policy import address_problem, network_policy

    assert address_problem("fd00:ec2::254") == "link-local/metadata"
    assert network_policy(allow_private=True).address_allowed("fd00:ec2::254") == "link-local/metadata"
