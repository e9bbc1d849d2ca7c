"""Prompts to token ids (chat template for instruct models) and streamed detokenisation."""

from __future__ import annotations

from jaxspec.errors import JaxspecError


def encode_conversation(tokenizer, messages: list[dict[str, str]], chat: bool = True) -> list[int]:
    """messages [{"role", "content"}, ...] ending with a user turn -> prompt token ids.

    With `chat` and a chat template, the template is applied with the assistant prompt
    added; otherwise the turns' contents are joined and tokenised as plain text.
    """
    if not any(m["content"].strip() for m in messages):
        raise JaxspecError("empty prompt: pass some text to generate from")
    if tokenizer is None:
        raise JaxspecError(
            "the model has no tokenizer to encode text with: pass token ids, or use a model "
            "folder (or .gguf) that holds one"
        )
    return _encode(tokenizer, messages, chat, reply_next=True)


def _encode(tokenizer, messages: list[dict[str, str]], chat: bool, reply_next: bool) -> list[int]:
    """messages -> token ids: the chat template's rendering (with the assistant prompt after
    it if reply_next) when `chat` and there is one, else the contents joined by newlines."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=reply_next
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode("\n".join(m["content"] for m in messages)))


def encode_reply(tokenizer, messages: list[dict[str, str]], prompt: list[int],
                 reply: str) -> list[int] | None:  # fmt: skip
    """The token ids an assistant `reply` to messages (ending with a user turn) adds after
    their ids `prompt` (encode_conversation's): with a chat template, its rendering with
    the end of the turn; without one, "\n" + reply (no end token); None where the rendered
    conversation does not start with `prompt`."""
    ids = _encode(tokenizer, [*messages, {"role": "assistant", "content": reply}], True, False)
    return ids[len(prompt) :] if ids[: len(prompt)] == prompt else None


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    return encode_conversation(tokenizer, [{"role": "user", "content": prompt}], chat)


class TextStream:
    """Turns token ids arriving in pieces into printable text increments."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
            return ""
        new, self.printed = text[self.printed :], len(text)
        return new
