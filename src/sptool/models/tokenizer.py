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
