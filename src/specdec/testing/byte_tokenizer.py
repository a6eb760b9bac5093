"""A byte-level tokenizer for tests and the tiny replicas: token i < 256 is byte i, 256 is EOS.

It has what the server reads of a tokenizer (`encode`, `decode`, `fewest_tokens`, `render_chat`,
`encode_parts`) and what the engine reads (`eos_token_ids`, `special_ids`, `bos_token_id`, `get_vocab`).
A chat renders as `<role>content\n` per message, then `<assistant>`.
"""

from __future__ import annotations

EOS = 256


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS. A multi-byte character spans several tokens."""

    eos_token_ids = (EOS,)
    vocab_size = 257
    bos_token_id = None
    pad_token_id = None
    special_ids = frozenset({EOS})

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def fewest_tokens(self, text: str, enough: int | None = None) -> int:
        return len(text)  # a character is one to four bytes

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        if messages[0]["role"] == "assistant":
            raise ValueError("Conversations must start with a user or system message")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, special_text: bool = False,
                    tools=None):
        return [(self.apply_chat_template(messages, add_generation_prompt, tools), True)]  # no special tokens here

    def encode_parts(self, parts) -> list[int]:
        return [t for text, _ in parts for t in self.encode(text)]

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab_size)}
