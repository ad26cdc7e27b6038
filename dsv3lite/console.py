"""The command line's stderr: notes held back while a reply streams to stdout, dimmed status lines, and the notes
about a reply that the terminal chat and `generate` share."""
from __future__ import annotations

import contextlib
import sys

import click


class Console:
    """stderr lines that arrive while a reply streams to stdout (engine notes such as "MTP speculation turned
    off") are held back and printed on their own line once the stream has ended its line."""

    def __init__(self):
        self.streaming = False
        self.held: list[str] = []

    def log(self, msg: str) -> None:
        if self.streaming:
            self.held.append(msg)
        else:
            click.echo(msg, err=True)

    @contextlib.contextmanager
    def stream(self):
        """The block streams a reply to stdout; it ends with the reply's newline, then the held lines follow."""
        self.streaming = True
        try:
            yield
        finally:
            self.streaming = False
            click.echo()
            held, self.held = self.held, []
            for msg in held:
                click.echo(msg, err=True)


console = Console()


def log(msg: str) -> None:
    console.log(msg)


def dim(text: str) -> str:
    return f"\033[2m{text}\033[0m" if sys.stderr.isatty() else text


def input_text(text: str, what: str) -> str:
    """`text` read from the user with undecodable bytes replaced by U+FFFD, said in one note."""
    from .tokenizer import replace_undecodable

    text, n = replace_undecodable(text)
    if n:
        log(f"note: {what} has {n} byte{'' if n == 1 else 's'} that {'is' if n == 1 else 'are'} not UTF-8: "
            f"replaced with U+FFFD")
    return text


def unknown_ids_note(ids: list[int], llm) -> str | None:
    """A note when the model produced ids the tokenizer has no text for (they print as nothing)."""
    if llm.tokenizer is None:
        return None
    vocab = llm.tokenizer.vocab_size
    unknown = [t for t in ids if t >= vocab]
    if not unknown:
        return None
    return (f"note: {len(unknown)} of the {len(ids)} generated tokens (e.g. id {unknown[0]}) are past the "
            f"tokenizer's {vocab} tokens and print as nothing (the checkpoint's vocab_size is "
            f"{llm.args.vocab_size})")
