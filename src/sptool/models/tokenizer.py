"""The text a model sees and the tokenizer that makes it, shared by every backend and by the
trainer (``train-step`` scores exactly the text that was sampled)."""

from __future__ import annotations

from sptool.models.base import Prompt, split_response_prefix


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def render_prompt(tokenizer, prompt: Prompt, chat_template: bool = True) -> str:
    """The exact text the model sees: chat template with generation prompt, or plain text, then
    the response prefix (a trailing assistant message) if any.

    Shared by every backend and by ``train-step`` so training scores exactly what was sampled.
    """
    messages, prefix = split_response_prefix(prompt)
    if isinstance(messages, str):
        return messages + prefix
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix
    return "\n\n".join(message["content"] for message in messages) + "\n\n" + prefix


def render_prompts(tokenizer, prompts: list[Prompt], chat_template: bool = True) -> list[str]:
    """:func:`render_prompt` of each prompt, the chat-templated ones in one ``apply_chat_template``
    call: the template is compiled and its globals set up once, not per prompt (512 eval prompts:
    16 ms a prompt at a time, 6 ms in one call, on this repository's CPU machine)."""
    split = [split_response_prefix(prompt) for prompt in prompts]
    texts: list[str | None] = [None] * len(prompts)
    templated = [index for index, (messages, _) in enumerate(split) if not isinstance(messages, str)]
    if chat_template and getattr(tokenizer, "chat_template", None) and len(templated) > 1:
        rendered = tokenizer.apply_chat_template([split[index][0] for index in templated], tokenize=False,
                                                 add_generation_prompt=True)
        for index, text in zip(templated, rendered):
            texts[index] = text + split[index][1]
    return [text if text is not None else render_prompt(tokenizer, prompt, chat_template)
            for text, prompt in zip(texts, prompts)]


#: below this many texts (or rows of ids) a batch is encoded (decoded) in one call: threads cost
#: more than they save
PARALLEL_ENCODE_MIN = 64


def _rust_copies(backend, threads: int | None) -> list:
    """One copy of a fast tokenizer's Rust ``backend`` per thread (at most 8, one per core), with no
    padding or truncation: threads that share one copy contend for its word cache's lock."""
    import copy
    import os

    threads = threads or max(1, min(8, os.cpu_count() or 1))
    first = copy.deepcopy(backend)
    first.no_padding()
    first.no_truncation()
    return [first] + [copy.deepcopy(first) for _ in range(threads - 1)]


def _on_threads(function, copies: list, items: list, name: str) -> list:
    """``function(copy, chunk)`` over ``items`` cut into one chunk per copy, each chunk on a thread
    of its own (the Rust calls drop the GIL), the results joined in order; one call for a small
    batch."""
    if len(items) < PARALLEL_ENCODE_MIN or len(copies) == 1:
        return list(function(copies[0], items))
    from concurrent.futures import ThreadPoolExecutor

    size = -(-len(items) // len(copies))
    chunks = [items[start:start + size] for start in range(0, len(items), size)]
    with ThreadPoolExecutor(len(chunks), thread_name_prefix=name) as pool:
        return [result for chunk in pool.map(function, copies, chunks) for result in chunk]


class PromptEncoder:
    """Left-padded ``input_ids`` and ``attention_mask`` of a batch of rendered prompts, the same
    as ``tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)`` with a
    left-padding tokenizer, at a fraction of its cost for a large batch.

    A fast tokenizer's Rust encoder runs without the GIL, so chunks of the batch are encoded on a
    few threads (``encode_batch_fast``: no character offsets), each thread with its own copy of the
    encoder (without padding or truncation), and padded here. Own copies, because threads that
    share one encoder contend for its word cache's lock: 512 eval prompts took 31 ms on 2 cores
    with one shared copy and 22 ms with two (one thread: 30 ms). ``sptool`` sets
    ``TOKENIZERS_PARALLELISM=false`` (the tokenizer's own threads do not survive a fork), which left
    512 prompts of the greedy eval stage to one core: 117 ms of host time in a 410 ms call on an
    H100 (``benchmarks/results/generation-h200/step-capture-h100/``). A slow (Python) tokenizer is
    called as before."""

    def __init__(self, tokenizer, threads: int | None = None):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.fast = backend is not None and tokenizer.padding_side == "left" and tokenizer.pad_token_id is not None
        if self.fast:
            self.encoders = _rust_copies(backend, threads)

    @staticmethod
    def _encode_batch(encoder, texts: list[str]):
        return getattr(encoder, "encode_batch_fast", encoder.encode_batch)(texts, add_special_tokens=False)

    def __call__(self, texts: list[str]):
        """``(input_ids, attention_mask)``: CPU tensors of rows x the longest prompt."""
        import torch

        if not self.fast:
            encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            return encoded["input_ids"], encoded["attention_mask"]
        encodings = _on_threads(self._encode_batch, self.encoders, texts, "sptool-encode")
        rows = [encoding.ids for encoding in encodings]
        width = max(map(len, rows), default=0)
        pad = [self.tokenizer.pad_token_id] * width
        ones, zeros = [1] * width, [0] * width
        input_ids = torch.tensor([pad[:width - len(ids)] + ids for ids in rows], dtype=torch.long)
        attention_mask = torch.tensor([zeros[:width - len(ids)] + ones[:len(ids)] for ids in rows], dtype=torch.long)
        return input_ids.reshape(len(texts), width), attention_mask.reshape(len(texts), width)


class TextDecoder:
    """The texts of many rows of token ids, each equal to ``tokenizer.decode(ids,
    skip_special_tokens=True)``, at a fraction of its cost for a large batch: a fast tokenizer's
    Rust ``decode_batch`` on a few threads, each with its own copy (as :class:`PromptEncoder`).
    512 rows of 64 tokens took 15 ms a row at a time on one core, 11 ms in one Rust call. A slow
    tokenizer, or one that cleans up tokenization spaces after decoding, is called a row at a
    time as before."""

    def __init__(self, tokenizer, threads: int | None = None):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.fast = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        if self.fast:
            self.decoders = _rust_copies(backend, threads)

    @staticmethod
    def _decode_batch(decoder, rows: list[list[int]]) -> list[str]:
        return decoder.decode_batch(rows, skip_special_tokens=True)

    def __call__(self, rows: list[list[int]]) -> list[str]:
        if not self.fast:
            return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in rows]
        return _on_threads(self._decode_batch, self.decoders, [list(ids) for ids in rows], "sptool-decode")
