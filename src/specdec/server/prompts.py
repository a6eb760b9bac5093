"""Prompt ids of chat and completion requests, run in a worker thread; a text certainly longer than the
context is refused before it is tokenized."""

from __future__ import annotations

from specdec.server.protocol import APIError, ContextLengthError


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                     add_generation_prompt: bool = True, context: int | None = None,
                     special_text: bool = False, completion_room: int = 1, param: str = "messages") -> list[int]:
    """The conversation's prompt ids; special-token text in the messages stays plain text unless
    `special_text` (see `Tokenizer.render_chat`). Refused at once if certainly longer than `context` less
    `completion_room` (an error naming `param`: the field the messages came in)."""
    try:
        parts = tokenizer.render_chat(messages, add_generation_prompt, special_text, tools=tools)
    except Exception as e:  # the template refused the conversation (raise_exception), or there is none
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages",
                       code="invalid_value") from None
    refuse_if_too_long(tokenizer, "".join(text for text, _ in parts), context, param, completion_room)
    return tokenizer.encode_parts(parts)


def completion_prompt_ids(tokenizer, prompt: str | list[int], param: str = "prompt", context: int | None = None
                           ) -> list[int]:
    if isinstance(prompt, str):
        refuse_if_too_long(tokenizer, prompt, context, param)
        return tokenizer.encode(prompt, add_special_tokens=True)
    vocab = tokenizer.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in the {param} is outside the vocabulary [0, {vocab})", param=param,
                       code="invalid_value")
    return list(prompt)


def refuse_if_too_long(tokenizer, text: str, context: int | None, param: str, completion_room: int = 1) -> None:
    """Refuse, before tokenizing it, a `text` that certainly does not fit the `context` with
    `completion_room` tokens to spare (`Tokenizer.fewest_tokens`), as the context check after tokenizing
    would (a 3 MB prompt took 3.6 s to tokenize)."""
    if context is None:
        return
    most = context - completion_room
    if (at_least := tokenizer.fewest_tokens(text, enough=most)) > most:  # (it may stop weighing past `most`)
        raise ContextLengthError(context, at_least, param, at_least=True)
