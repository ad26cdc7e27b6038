"""Splits a reply written DeepSeek-R1 style, `<think>reasoning</think>answer`, into reasoning and content as it streams.

The server returns the two parts as `reasoning_content` and `content`; the web UI shows the reasoning folded away.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def uses_reasoning(tokenizer) -> bool:
    """Does this checkpoint's chat template speak of <think> blocks (R1, V3.1)? Then its replies get split."""
    templates = getattr(tokenizer, "chat_templates", None) or {}
    return any(OPEN in t or CLOSE in t for t in templates.values())


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open <think> (templates that start the reasoning themselves)."""
    at = prompt_text.rfind(OPEN)
    return at >= 0 and prompt_text.find(CLOSE, at) < 0


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (held back: the tag may complete later)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """feed(text) -> (reasoning, content) that became certain with this text; flush() at the end of the reply.

    A reply is reasoning from a leading <think> (whitespace before it is dropped), or from its first character when
    the prompt already opened one (in_reasoning=True), up to the first </think>; the rest, with the blank lines after
    </think> dropped, is content. A reply that does not open with <think> is all content.
    """

    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"    # start | reasoning | after | content
        self.pending = ""                                         # text held back: maybe part of a tag

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(OPEN):
                    self.pending, self.state = head[len(OPEN):], "reasoning"
                elif not head or OPEN.startswith(head):
                    break                                         # could still become <think>
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                at = self.pending.find(CLOSE)
                if at >= 0:
                    reasoning.append(self.pending[:at])
                    self.pending, self.state = self.pending[at + len(CLOSE):], "after"
                    continue
                keep = _partial_tag(self.pending, CLOSE)
                reasoning.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            elif self.state == "after":
                self.pending = self.pending.lstrip()
                if self.pending:
                    self.state = "content"
            else:
                content.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The held-back text, once the reply has ended (an unfinished tag is plain text after all)."""
        held, self.pending = self.pending, ""
        if self.state == "reasoning":
            return held, ""
        if self.state == "after":
            return "", ""
        return "", held


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """Whole-text form: -> (reasoning, or None when there is none; content)."""
    s = ReasoningSplitter(in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return (r1 + r2) or None, c1 + c2
