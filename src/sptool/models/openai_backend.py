"""The ``openai`` backend: any OpenAI-compatible completions server (``vllm serve``, SGLang).

Prompts are rendered locally with the model's own chat template (:func:`sptool.models.hf.
render_prompt`, the same function and tokenizer as the ``hf`` and ``vllm`` backends), so all three
backends send byte-identical prompt text; the text goes to ``/v1/completions``. When the model's
tokenizer is not available locally (a hub id only the server has), the chat messages go to
``/v1/chat/completions`` instead and the server applies its template.

Scale-out: several base URLs (``--base-url URL1,URL2`` or ``SPTOOL_BASE_URL``) share the prompts
round-robin, with a bounded number of requests in flight (threads). Each request asks for the
``n`` samples of one prompt. Connection failures, 429 and 5xx answers are retried with
exponential backoff; a server that stays down or a model it does not serve becomes one
:class:`RuntimeFailure` line. Only the standard library is used (``urllib``, in
:mod:`sptool.models.openai_http`).

Live weights (a run that trains): :meth:`OpenAIBackend.update_weights` makes every server
generate from a new checkpoint directory, one server after the other, through vLLM's own
endpoints (``sptool serve`` starts vLLM with them; a plain ``vllm serve`` needs
``VLLM_SERVER_DEV_MODE=1``, and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` with ``--enable-lora``
for adapters). Full weights: ``/pause`` (in-flight requests finish), ``/collective_rpc``
``reload_weights`` from the directory, ``/reset_prefix_cache``, ``/update_weight_version`` (the
checkpoint path: a restarted server is recognised), ``/resume``. A LoRA adapter:
``/v1/load_lora_adapter`` under a name derived from the checkpoint (the base weights are
reloaded first when the server holds others), the previous adapter unloaded; requests then name
the adapter. The servers read the checkpoint from their own disk (same path: a shared or local
filesystem). A server that is down or answers an error stops the update with one line, and no
generation runs until an update reached every server; before each ``generate`` call the servers'
weight versions are checked, so a server restarted with its start-up weights is an error, not
silently stale samples.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sptool.models.base import Prompt, Sample, SamplingParams, cut_at_stop, split_response_prefix
from sptool.models.openai_http import HTTPClient, env_default, parse_base_urls
from sptool.core.records import RuntimeFailure


class OpenAIBackend(HTTPClient):
    """Generation through one or more OpenAI-compatible HTTP servers."""

    name = "openai"

    def __init__(self, model: str = "tiny", *, base_url: str | list[str] | None = None,
                 chat_template: bool = True, concurrency: int | None = None,
                 timeout: float | None = None, retries: int | None = None, backoff_s: float = 0.5, api_key: str | None = None,
                 served_model: str | None = None, log=None, **_: Any):
        self.model_id = model
        self.base_urls = parse_base_urls(base_url)
        self.chat_template = chat_template
        # defaults, overridable from the environment (SPTOOL_OPENAI_CONCURRENCY, …_TIMEOUT, …_RETRIES)
        self.concurrency = max(1, int(env_default(concurrency, "SPTOOL_OPENAI_CONCURRENCY", 8)))
        self.timeout = float(env_default(timeout, "SPTOOL_OPENAI_TIMEOUT", 600.0))
        self.retries = max(0, int(env_default(retries, "SPTOOL_OPENAI_RETRIES", 3)))
        self.backoff_s = backoff_s
        self.api_key = api_key or os.environ.get("SPTOOL_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self.log = log
        self._round_robin = 0
        self._lock = threading.Lock()
        self.tokenizer, self.local_path = self._local_tokenizer(model)
        self.served_model = served_model or self._pick_served_model(model)
        self.base_served_model = self.served_model
        self.eos_ids = self._eos_ids()
        self.weights: str | None = None   # the checkpoint every server holds, after update_weights
        self.adapter: str | None = None   # its served adapter name (LoRA checkpoints)
        self._stale: str | None = None    # why generation must not run (a failed update)

    # -- setup -------------------------------------------------------------------------------

    def _local_tokenizer(self, model: str):
        """The model's tokenizer when it is available locally (else the chat endpoint is used)."""
        from sptool.models.tokenizer import load_tokenizer
        from sptool.models.resolve import resolve_model

        try:
            path = resolve_model(model, log=self.log)
        except RuntimeFailure:
            return None, None
        try:
            return load_tokenizer(path), path
        except Exception:  # noqa: BLE001 - a hub id not in the local cache: the server renders
            if self.log:
                self.log(f"openai backend: no local tokenizer for '{model}'; "
                         "using /chat/completions (the server applies its chat template)")
            return None, None

    def _pick_served_model(self, model: str) -> str:
        """Match ``model`` (or its resolved local path) against each server's ``/models``."""
        chosen = None
        for base in self.base_urls:
            answer = self._request(base, "GET", "/models", None, retries=self.retries)
            entries = [entry for entry in answer.get("data", []) if isinstance(entry, dict)]
            served = [entry.get("id") for entry in entries]
            candidates = [model]
            if self.local_path:
                candidates += [self.local_path, os.path.abspath(self.local_path),
                               os.path.basename(self.local_path.rstrip("/"))]
            match = next((name for name in candidates if name in served), None)
            if match is None and self.local_path:  # served under another name: match the directory
                local = os.path.realpath(self.local_path)
                match = next((entry.get("id") for entry in entries if not entry.get("parent")
                              and os.path.realpath(str(entry.get("root") or "")) == local), None)
            if match is None:
                raise RuntimeFailure(
                    f"the server at {base} does not serve model '{model}'; it serves: "
                    f"{', '.join(map(str, served)) or '(none)'} (pass one of these with -m/--model)")
            if chosen is not None and match != chosen:
                raise RuntimeFailure(f"servers disagree on the model name: '{chosen}' vs '{match}' at {base}")
            chosen = match
        return chosen

    def _eos_ids(self) -> list[int]:
        """The same end-of-sequence ids the hf backend stops on (generation config + tokenizer)."""
        if self.tokenizer is None:
            return []
        ids: list[int] = []
        try:
            from transformers import GenerationConfig

            value = GenerationConfig.from_pretrained(self.local_path).eos_token_id
            ids = list(value) if isinstance(value, (list, tuple)) else [value] if value is not None else []
        except Exception:  # noqa: BLE001 - no generation_config.json: the tokenizer's EOS only
            pass
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def render(self, prompt: Prompt) -> str:
        from sptool.models.tokenizer import render_prompt

        return render_prompt(self.tokenizer, prompt, self.chat_template)

    # -- generation --------------------------------------------------------------------------

    def _body(self, prompt: Prompt, n: int, params: SamplingParams, seed: int) -> tuple[str, dict]:
        body: dict[str, Any] = {
            "model": self.served_model, "n": n, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p if params.temperature > 0 else 1.0,
            "seed": seed,
        }
        if params.stop:
            # the stop strings, kept in the text like the other backends (a vLLM/SGLang extension)
            body.update(stop=list(params.stop), include_stop_str_in_output=True)
        if self.tokenizer is None:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            body["messages"] = messages
            if split_response_prefix(prompt)[1]:
                # the reply continues the trailing assistant message (vLLM/SGLang extension)
                body.update(add_generation_prompt=False, continue_final_message=True)
            if params.logprobs:
                body["logprobs"] = True
            return "/chat/completions", body
        body["prompt"] = self.render(prompt)
        # vLLM/SGLang extensions, so stopping and counting match the hf backend exactly: stop on
        # the same EOS ids, no BOS added to the rendered text, output token ids returned.
        body.update(stop_token_ids=self.eos_ids, add_special_tokens=False, return_token_ids=True,
                    skip_special_tokens=True, top_k=-1 if params.temperature > 0 else None)
        if body["top_k"] is None:
            body.pop("top_k")
        if params.logprobs:
            body["logprobs"] = 0  # only the sampled token's log-probability
        return "/completions", body

    def _one(self, index: int, prompt: Prompt, n: int, params: SamplingParams) -> list[Sample]:
        path, body = self._body(prompt, n, params, seed=params.seed * 1_000_003 + index)
        try:
            answer = self._request(self._next_base(), "POST", path, body, retries=self.retries,
                                   deadline=params.deadline)
        except RuntimeFailure:
            if params.deadline is not None and params.seconds_left() <= 0:
                return []  # cut by the caller's deadline: the caller drops the incomplete batch
            raise
        choices = sorted(answer.get("choices", []), key=lambda choice: choice.get("index", 0))
        if len(choices) != n:
            raise RuntimeFailure(f"the server returned {len(choices)} choices for n={n}")
        prefix = split_response_prefix(prompt)[1]
        return [self._sample(choice, params, prefix) for choice in choices]

    def _sample(self, choice: dict, params: SamplingParams, prefix: str = "") -> Sample:
        if "message" in choice:  # chat endpoint
            text = (choice.get("message") or {}).get("content") or ""
            logprobs = None
            content = (choice.get("logprobs") or {}).get("content")
            if params.logprobs and content:
                logprobs = [float(entry["logprob"]) for entry in content]
        else:
            text = choice.get("text") or ""
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            logprobs = [float(value) for value in logprobs] if params.logprobs and logprobs else None
        token_ids = choice.get("token_ids")
        if token_ids is not None:
            n_tokens = len(token_ids)
        elif logprobs is not None:
            n_tokens = len(logprobs)
        elif self.tokenizer is not None:
            n_tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            n_tokens += choice.get("finish_reason") == "stop"  # the EOS token
        else:
            n_tokens = max(1, len(text.split()))
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        stop_string = None
        if params.stop:
            reason = choice.get("stop_reason")  # vLLM: the stop string that matched
            if finish == "stop" and isinstance(reason, str) and reason in params.stop \
                    and not text.endswith(reason):
                text += reason  # a server that drops the stop string from the text
            text, stop_string = cut_at_stop(text, params.stop)
            if stop_string is not None:
                finish = "stop"
        return Sample(text=prefix + text, n_tokens=n_tokens, finish_reason=finish, logprobs=logprobs,
                      token_ids=token_ids, stop_string=stop_string)

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Sample]]:
        if not prompts:
            return []
        self._check_weights()
        workers = min(self.concurrency, len(prompts))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sptool-openai") as pool:
            futures = [pool.submit(self._one, index, prompt, n, params)
                       for index, prompt in enumerate(prompts)]
            try:
                return [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    def close(self) -> None:
        pass

    # -- live weights ------------------------------------------------------------------------

    def update_weights(self, path: str) -> str:
        """Make every server generate from the checkpoint directory ``path`` (full weights or a
        peft adapter), one server after the other; returns ``"in-place"`` or ``"adapter"``.

        A server that already holds these weights is left alone (so a resumed run re-sends only
        what a restarted server lacks). Any failure is one :class:`RuntimeFailure` line naming the
        server and how many were updated; generation refuses to run until an update succeeds.
        """
        from sptool.models.resolve import resolve_model

        absolute = os.path.realpath(path if os.path.isdir(path) else resolve_model(path, log=self.log))
        if not os.path.isdir(absolute):
            raise RuntimeFailure(f"cannot update the servers' weights: {path} is not a checkpoint directory")
        adapter_base = _adapter_base(absolute)
        self._stale = f"the weight update to {path} did not reach every server"
        done = 0
        for base in self.base_urls:
            try:
                if adapter_base is None:
                    self._ensure_full_weights(base, absolute)
                else:
                    self._ensure_full_weights(base, adapter_base)
                    self._ensure_adapter(base, absolute)
            except RuntimeFailure as exc:
                raise RuntimeFailure(
                    f"weight update to {path} failed at {base} ({done} of {len(self.base_urls)} servers "
                    f"updated): {exc}") from None
            done += 1
        self.weights = absolute
        self.adapter = _adapter_name(self.base_served_model, absolute) if adapter_base else None
        self.served_model = self.adapter or self.base_served_model
        self.model_id = path
        self._stale = None
        return "adapter" if adapter_base else "in-place"

    @staticmethod
    def _root(base: str) -> str:
        """The server root of a base URL (vLLM's control endpoints are not under /v1)."""
        return base[:-3] if base.endswith("/v1") else base

    def _control(self, base: str, path: str, body: dict | None = None, method: str = "POST") -> dict:
        try:
            return self._request(self._root(base), method, path, body, retries=self.retries, text_ok=True)
        except RuntimeFailure as exc:
            if "HTTP 404" in str(exc) or "HTTP 405" in str(exc):
                raise RuntimeFailure(
                    f"{base} has no {path} endpoint: start the server with `sptool serve` (or vLLM with "
                    "VLLM_SERVER_DEV_MODE=1; adapters also need --enable-lora and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)") from None
            raise

    def _server_weights(self, base: str) -> str:
        """The full weights a server holds: its weight version (a checkpoint path we set), else
        the directory it started from (vLLM's version is ``default`` until first set)."""
        version = self._control(base, "/weight_info", method="GET").get("weight_version")
        if version not in (None, "", "default"):
            return str(version)
        answer = self._request(base, "GET", "/models", None, retries=self.retries)
        for entry in answer.get("data", []):
            if isinstance(entry, dict) and entry.get("id") == self.base_served_model:
                root = entry.get("root") or ""
                return os.path.realpath(root) if os.path.isdir(root) else root
        return ""

    def _ensure_full_weights(self, base: str, path: str) -> None:
        if self._server_weights(base) == path:
            return
        self._control(base, "/pause?mode=wait")
        try:
            answer = self._control(base, "/collective_rpc",
                                   {"method": "reload_weights", "kwargs": {"weights_path": path}})
            if "error" in answer:
                raise RuntimeFailure(f"reload_weights failed: {answer['error']}")
            self._control(base, "/reset_prefix_cache")
            self._control(base, "/update_weight_version", {"new_version": path})
        finally:
            try:
                self._control(base, "/resume")
            except RuntimeFailure:
                pass  # the error that matters is the one above (or the next request's)

    def _ensure_adapter(self, base: str, path: str) -> None:
        name = _adapter_name(self.base_served_model, path)
        answer = self._request(base, "GET", "/models", None, retries=self.retries)
        adapters = {entry.get("id"): entry.get("root") for entry in answer.get("data", [])
                    if isinstance(entry, dict) and entry.get("parent")}
        if adapters.get(name) != path:
            self._control(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path,
                                                         "load_inplace": name in adapters})
        for old in adapters:
            if old != name and str(old).startswith(self.base_served_model + "@"):
                self._control(base, "/v1/unload_lora_adapter", {"lora_name": old})

    def _check_weights(self) -> None:
        """Before generating: no failed update pending, and every server still holds the weights
        of the last update (a restarted server would silently serve its start-up weights)."""
        if self._stale:
            raise RuntimeFailure(f"{self._stale}; not generating from stale weights")
        if self.weights is None:
            return
        for base in self.base_urls:
            if self.adapter is not None:
                continue  # a restarted server does not know the adapter: the request itself fails
            held = self._server_weights(base)
            if held != self.weights:
                raise RuntimeFailure(f"the server at {base} holds the weights '{held or 'unknown'}', not "
                                     f"{self.model_id} (restarted?); update its weights again")


def _adapter_base(path: str) -> str | None:
    """The base model directory of a peft adapter checkpoint, or None for full weights."""
    config = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as handle:
        base = json.load(handle).get("base_model_name_or_path")
    if not base:
        raise RuntimeFailure(f"{config} names no base_model_name_or_path")
    from sptool.models.resolve import resolve_model

    return os.path.realpath(resolve_model(base))


def _adapter_name(served: str, path: str) -> str:
    """The served name of an adapter checkpoint: readable, and unique per directory."""
    import hashlib

    digest = hashlib.sha1(path.encode("utf-8")).hexdigest()[:8]
    return f"{served}@{os.path.basename(path.rstrip('/'))}-{digest}"
