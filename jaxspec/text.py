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
        raise JaxspecError("this checkpoint has no tokenizer; convert it from a folder with one")
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode("\n".join(m["content"] for m in messages)))


def encode_reply(tokenizer, messages: list[dict[str, str]], reply: str) -> list[int] | None:
    """The token ids an assistant `reply` to messages (ending with a user turn) adds after
    encode_conversation(messages): with a chat template, its rendering with the end of the
    turn; without one, "\n" + reply (no end token); None where the rendered conversation
    does not start with the prompt's ids."""
    prompt = encode_conversation(tokenizer, messages)
    turns = [*messages, {"role": "assistant", "content": reply}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(turns, tokenize=False)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        ids = list(tokenizer.encode("\n".join(m["content"] for m in turns)))
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
