"""Chat prompts rendered and tokenized so that what a client typed is always text.

A chat template writes control tokens around each message (``<|im_start|>user\\n ...
<|im_end|>``). Tokenizing the rendered prompt as one string would also turn the same
strings *typed in a message* into control tokens: a user could end their turn and open
a system turn of their own. So ``PromptEncoder.render_chat`` renders the template with a
unique sentinel in place of each message's content, checks that putting the contents
back gives exactly what the template renders from them, and records which spans of the
prompt are message contents. ``PromptEncoder.encode`` then tokenizes the template's
spans with special tokens parsed and the contents with special tokens as plain text
(the tokenizer's ``encode_special_tokens``). A template that rewrites contents (trims
them, splits them) cannot be split this way: its prompts are tokenized whole, and a
message that holds a special token's text is refused (400) rather than let through.

Completion prompts are the client's own raw prompt, template and all: their special
tokens are parsed, as vLLM does.

The work here is CPU-bound (seconds for a long prompt): the ingress runs it in a thread.
``check_length`` is the cheap bound that runs first, before any of it.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any

from orchestrator.errors import ContextLengthExceeded, InvalidRequest
from orchestrator.kv.session_tokens import continue_tokens
from orchestrator.serve.requests import ApiRequest

__all__ = ["PromptEncoder", "RenderedChat"]


class RenderedChat(str):
    """A chat prompt as rendered by the model's template. A ``str`` (the prompt's text,
    which the router and the session books keep) that also knows where the messages'
    contents lie: ``content_spans`` are ``(start, end)`` offsets, in order; ``None``
    when the template could not be split (then the prompt is tokenized whole)."""

    content_spans: tuple[tuple[int, int], ...] | None

    def __new__(
        cls, text: str, content_spans: tuple[tuple[int, int], ...] | None = None
    ) -> RenderedChat:
        self = super().__new__(cls, text)
        self.content_spans = content_spans
        return self

    def __reduce__(self) -> tuple[type[RenderedChat], tuple[str, Any]]:
        return RenderedChat, (str(self), self.content_spans)


class PromptEncoder:
    """Renders and tokenizes prompts with one Hugging Face tokenizer. Thread-safe: the
    tokenizer's own state is never changed (content is tokenized by a copy of its
    backend that treats special tokens as text)."""

    def __init__(self, tokenizer: Any, *, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.vocab_size = len(tokenizer)
        self._as_text: Any = None
        if backend is not None:
            from tokenizers import Tokenizer

            self._as_text = Tokenizer.from_str(backend.to_str())
            self._as_text.encode_special_tokens = True
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_tokens = tuple(
            sorted({t.content for t in decoder.values() if getattr(t, "special", False)})
        )
        # A token covers at most this many characters: the longest vocabulary entry (a
        # byte-level entry has one character per byte, never fewer than it decodes to).
        self.max_chars_per_token = max((len(t) for t in tokenizer.get_vocab()), default=1)

    # ---- cheap checks, before any real work ----------------------------------------

    def check_length(self, req: ApiRequest) -> None:
        """Refuse a prompt whose text alone cannot fit the context (400), counting
        characters only: each token covers at most ``max_chars_per_token`` of them."""
        if req.kind == "chat":
            self._check_chars(sum(len(content) for _, content in req.messages), "messages")
        else:
            self._check_chars(len(req.prompt_text or ""), "prompt")

    def _check_chars(self, num_chars: int, param: str) -> None:
        bound = self.max_model_len * self.max_chars_per_token
        if num_chars > bound:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens, at "
                f"most {bound} characters of text; your prompt has {num_chars} characters. "
                "Shorten the prompt or the history.",
                param=param,
            )

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        if max(token_ids) >= self.vocab_size:
            raise InvalidRequest(
                f"prompt token id {max(token_ids)} is outside the vocabulary (size "
                f"{self.vocab_size})",
                param="prompt",
            )

    # ---- rendering -------------------------------------------------------------------

    def render_chat(
        self, messages: Sequence[tuple[str, str]], *, continue_final_message: bool = False
    ) -> RenderedChat:
        """The chat prompt of ``messages``: with the assistant's generation prompt, or
        (``continue_final_message``) ending inside the final assistant message, whose
        text the model goes on writing. Linear in the prompt's length, whatever the
        number of messages."""
        cont = continue_final_message
        contents = [content for _, content in messages]
        text = self._render([(role, c) for role, c in messages], cont)
        self._check_chars(len(text), "messages")  # the template's text counts too
        # A sentinel per content, which no content holds: private-use characters around
        # a random nonce and the message's index.
        nonce = f"\U000f0000{secrets.token_hex(8)}."
        if any(nonce in c for c in contents):
            return self._unsplit(text, contents)
        marked = self._render(
            [(role, f"{nonce}{i}\U000f0001") for i, (role, _) in enumerate(messages)], cont
        )
        spans: list[tuple[int, int]] = []
        rebuilt: list[str] = []
        seen: set[int] = set()
        at = offset = 0  # in ``marked``, in the rebuilt text
        for match in re.finditer(re.escape(nonce) + "([0-9]+)\U000f0001", marked):
            i = int(match.group(1))
            if i in seen or i >= len(contents):
                return self._unsplit(text, contents)  # repeated by the template
            seen.add(i)
            content = contents[i]
            rebuilt += (marked[at : match.start()], content)
            offset += match.start() - at
            spans.append((offset, offset + len(content)))
            offset += len(content)
            at = match.end()
        rebuilt.append(marked[at:])
        if len(seen) != len(contents) or "".join(rebuilt) != text:
            return self._unsplit(text, contents)  # dropped or rewritten by the template
        return RenderedChat(text, tuple(spans))

    def _render(self, messages: list[tuple[str, str]], cont: bool = False) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(
                "this model has no chat template: send the prompt to /v1/completions",
                param="messages",
            )
        import jinja2

        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages],
                add_generation_prompt=not cont,
                continue_final_message=cont,
                tokenize=False,
            )
        except jinja2.TemplateError as exc:  # the template's own raise_exception(...)
            raise InvalidRequest(
                f"this model's chat template refused the conversation: {str(exc)[:200]}",
                param="messages",
            ) from None
        except ValueError:
            if not cont:
                raise
            # The template rewrote the final message: there is no end of it to go on from.
            raise InvalidRequest(
                "this model's chat template rewrites the final message, so it cannot be "
                "continued; leave continue_final_message out",
                param="continue_final_message",
            ) from None
        return str(text)

    def _unsplit(self, text: str, contents: list[str]) -> RenderedChat:
        for i, content in enumerate(contents):
            for token in self.special_tokens:
                if token in content:
                    raise InvalidRequest(
                        f"messages[{i}].content holds the text of the special token "
                        f"{token!r}, and this model's chat template rewrites message "
                        "contents, so kvtide cannot keep it as plain text; remove it",
                        param=f"messages[{i}].content",
                    )
        return RenderedChat(text, None)

    # ---- tokenizing ------------------------------------------------------------------

    def encode(
        self, prompt: str, last_text: str | None = None, last_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """Token ids of ``prompt`` (a ``RenderedChat``, or a completion's raw prompt),
        continuing the session's last turn (``last_text``/``last_token_ids``, see
        ``orchestrator.kv.session_tokens``) where the prompt extends it."""
        chat = isinstance(prompt, RenderedChat)

        def full(_: str) -> list[int]:
            # A chat template writes its own BOS; a raw completion prompt gets the
            # tokenizer's.
            return self._encode_from(prompt, 0, bos=not chat)

        def suffix(tail: str) -> list[int]:
            return self._encode_from(prompt, len(prompt) - len(tail), bos=False)

        return continue_tokens(last_text, last_token_ids, str(prompt), full=full, suffix=suffix)

    def _encode_from(self, prompt: str, start: int, *, bos: bool) -> list[int]:
        """Tokens of ``prompt[start:]``: a chat prompt's contents as plain text."""
        spans = prompt.content_spans if isinstance(prompt, RenderedChat) else None
        if spans is None:
            return self._special(prompt[start:], bos=bos)
        ids: list[int] = []
        at = start
        for lo, hi in spans:
            if hi <= at:
                continue
            if lo > at:
                ids += self._special(prompt[at:lo], bos=False)
            ids += self._text(prompt[max(lo, at) : hi])
            at = hi
        if at < len(prompt):
            ids += self._special(prompt[at:], bos=False)
        return ids

    def _special(self, text: str, *, bos: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=bos)) if text else []

    def _text(self, text: str) -> list[int]:
        if not text:
            return []
        if self._as_text is not None:
            return list(self._as_text.encode(text, add_special_tokens=False).ids)
        # A Python tokenizer takes the flag per call.
        return list(
            self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        )
