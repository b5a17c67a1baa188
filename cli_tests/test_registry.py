"""The one registry: lazy "module:attr" entries, decorator registration, did-you-mean errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sptool.core.records import UsageError
from sptool.core.registry import Registry


def test_lazy_entry_is_imported_on_first_get_only():
    registry = Registry("thing", {"dumps": "json:dumps"})
    assert registry.target("dumps") == "json:dumps"  # not imported yet
    import json

    assert registry.get("dumps") is json.dumps
    assert registry.target("dumps") is json.dumps  # resolved once, then cached


def test_decorator_and_dict_registration_and_sorted_names():
    registry: Registry = Registry("objective", {"zeta": len})

    @registry.register("alpha")
    def alpha():
        return "a"

    assert registry.get("alpha") is alpha and registry.get("alpha")() == "a"
    assert registry.names() == ["alpha", "zeta"] and list(registry) == ["alpha", "zeta"]
    assert "alpha" in registry and "beta" not in registry and len(registry) == 2
    with pytest.raises(ValueError, match="module:attribute"):
        registry.register("bad", "no_colon_here")


def test_unknown_name_suggests_the_closest_and_lists_sorted_choices():
    registry = Registry("backend", {"vllm": "x:y", "hf": "x:y", "scripted": "x:y"})
    with pytest.raises(UsageError) as caught:
        registry.get("hff")
    assert str(caught.value) == "unknown backend 'hff'. Did you mean 'hf'? Choose from: hf, scripted, vllm"
    assert caught.value.exit_code == 2
    with pytest.raises(UsageError) as caught:
        registry.check("zzzzz")
    assert "Did you mean" not in str(caught.value) and "Choose from: hf, scripted, vllm" in str(caught.value)


def test_sptool_tables_use_the_registry_and_stay_lazy():
    code = ("import sys; from sptool.models.base import BACKENDS; from sptool.stages.corpus.search import SEARCH_BACKENDS;"
            "print(BACKENDS.names(), SEARCH_BACKENDS.names(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("['hf', 'openai', 'scripted', 'vllm'] ['brave', 'local', 'searxng', 'wikipedia'] False")
