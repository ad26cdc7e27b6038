"""`dsv3lite chat`'s read-eval-print loop: messages read with readline (history kept in a file, a multi-line
message as one entry), replies streamed with the keyboard's echo off, and a conversation that outgrows the context
shortened from its oldest exchanges instead of ending the session."""
from __future__ import annotations

import contextlib
import os
import sys

import click

from .console import console, dim, input_text, log, unknown_ids_note
from .errors import Terminated, UserError
from .stats import summary

CHAT_HELP = """commands:
  /exit        leave (Ctrl-D works too)
  /clear       forget the conversation
  /help        this text
  \"\"\"          start or end a multi-line message
Left/Right and the usual readline keys edit the line; Up/Down recall earlier messages (kept in
~/.dsv3lite_history, or the file DSV3LITE_HISTORY names; DSV3LITE_HISTORY= keeps none).
Ctrl-C stops the current reply. When the conversation outgrows --ctx-size, its oldest exchanges are dropped
(a note says so)."""

HISTORY_ENV = "DSV3LITE_HISTORY"
HISTORY_LINES = 1000
QUOTES = '\"\"\"'
NEWLINE_IN_FILE = "\\n"          # a multi-line entry's newlines in the history file (one line per entry there)


class LineEditing:
    """readline line editing and history when stdin and stdout are a terminal (else `active` is False)."""

    def __init__(self):
        self.readline, self.path = None, None
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            return
        try:
            import readline
        except ImportError:               # Python built without readline: plain input()
            return
        path = os.environ.get(HISTORY_ENV)
        path = os.path.join(os.path.expanduser("~"), ".dsv3lite_history") if path is None else path
        self.readline = readline
        readline.set_history_length(HISTORY_LINES)
        if path:
            self.path = path
            with contextlib.suppress(OSError):
                readline.read_history_file(path)
            self._map_entries(lambda e: e.replace(NEWLINE_IN_FILE, "\n") if e.startswith(QUOTES) else e)

    @property
    def active(self) -> bool:
        return self.readline is not None

    def _map_entries(self, fn) -> None:
        rl = self.readline
        for i in range(rl.get_current_history_length()):
            entry = rl.get_history_item(i + 1)
            if entry is not None and fn(entry) != entry:
                rl.replace_history_item(i, fn(entry))

    def replace_last(self, n: int, entry: str) -> None:
        """The last `n` history entries (a multi-line message's lines) become one."""
        if not self.active:
            return
        rl = self.readline
        for _ in range(min(n, rl.get_current_history_length())):
            rl.remove_history_item(rl.get_current_history_length() - 1)
        rl.add_history(entry)

    def save(self) -> None:
        if self.readline is None or not self.path:
            return
        self._map_entries(lambda e: e.replace("\n", NEWLINE_IN_FILE))
        try:
            self.readline.write_history_file(self.path)
        except OSError as e:
            log(f"note: could not save the chat history to {self.path}: {e.strerror or e}")


def read_message(editing: LineEditing) -> str:
    """One user message (EOFError at the end of input). Lines between two '\"\"\"' form one multi-line message,
    kept in the history as one entry."""
    line = input_text(input(">>> "), "the message")
    if not line.strip().startswith(QUOTES):
        return line
    first = line.strip()[3:]
    if first.endswith(QUOTES):
        return first[:-3]
    lines, typed = [first] if first else [], [line]
    while True:
        more = input_text(input("... "), "the message")
        typed.append(more)
        if more.rstrip().endswith(QUOTES):
            lines.append(more.rstrip()[:-3])
            message = "\n".join(lines)
            editing.replace_last(sum(1 for t in typed if t), QUOTES + message + QUOTES)   # readline kept each line
            return message
        lines.append(more)


@contextlib.contextmanager
def keys_unechoed():
    """While a reply streams, keys typed on the terminal are neither echoed into it nor left for the next prompt
    (an arrow key would print as ^[[A in the reply). Ctrl-C still interrupts."""
    fd = sys.stdin.fileno() if sys.stdin is not None and not sys.stdin.closed and sys.stdin.isatty() else None
    if fd is None:
        yield
        return
    import termios

    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def fit_conversation(tokenizer, messages: list[dict], keep: int, ctx_size: int, room: int) -> tuple[list[int], int]:
    """The prompt ids of `messages` for the next reply, dropping the oldest exchanges after the first `keep`
    messages (the system prompt) while the prompt and `room` reply tokens exceed `ctx_size`. Dropped messages are
    removed from `messages`. -> (ids, messages dropped). UserError when the newest message alone leaves no room."""
    dropped = 0
    while True:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
        if len(ids) + room <= ctx_size:
            return ids, dropped
        turn = next((i for i in range(keep + 1, len(messages)) if messages[i]["role"] == "user"), None)
        if turn is None:                      # only the newest message is left
            if len(ids) < ctx_size:
                return ids, dropped
            raise UserError(f"this message is {len(ids)} tokens with the chat template but the context holds "
                            f"{ctx_size}: shorten it, or restart with a larger --ctx-size")
        dropped += turn - keep
        del messages[keep:turn]


def chat_loop(llm, sampling: dict, base: list[dict]) -> None:
    """Read messages and stream replies until /exit or the end of input. A message that cannot run (too long for
    the context, say) is one line and the session goes on."""
    history = list(base)
    editing = LineEditing()
    log(dim("type /help for commands, /exit to leave"))
    try:
        while True:
            try:
                msg = read_message(editing)
            except EOFError:
                click.echo()
                return
            except KeyboardInterrupt as e:
                if isinstance(e, Terminated):
                    raise
                click.echo()
                log("(use /exit or Ctrl-D to leave)")
                continue
            cmd = msg.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit", "/bye"):
                return
            if cmd == "/help":
                click.echo(CHAT_HELP)
                continue
            if cmd == "/clear":
                history[:] = base
                llm.reset()
                log(dim("conversation cleared"))
                continue
            if cmd.startswith("/"):
                log(f"unknown command {cmd.split()[0]} (/help lists them)")
                continue
            history.append({"role": "user", "content": msg})
            try:
                _reply(llm, sampling, history, len(base))
            except UserError as e:
                history.pop()
                log(f"error: {e}")
    finally:
        editing.save()


def _reply(llm, sampling: dict, history: list[dict], keep: int) -> None:
    room = min(sampling["max_tokens"], llm.ctx_size // 2)     # reply tokens the context keeps free
    ids, dropped = fit_conversation(llm.tokenizer, history, keep, llm.ctx_size, room)
    if dropped:
        log(dim(f"note: the conversation outgrew the {llm.ctx_size}-token context: dropped its oldest {dropped} "
                f"message{'' if dropped == 1 else 's'} (/clear forgets all)"))
    reply, out_ids, finish = [], [], None
    stream = llm.generate(ids, **sampling)
    with console.stream(), keys_unechoed():
        try:
            for chunk in stream:
                reply.append(chunk.text)
                if chunk.token_id is not None:
                    out_ids.append(chunk.token_id)
                finish = chunk.finish_reason
                click.echo(chunk.text, nl=False)
                sys.stdout.flush()
        except KeyboardInterrupt as e:
            if isinstance(e, Terminated):
                raise
            finish = "stopped"
            log(dim("[stopped]"))
        finally:
            stream.close()
    history.append({"role": "assistant", "content": "".join(reply)})
    note = unknown_ids_note(out_ids, llm)
    if note:
        log(note)
    log(dim(summary(llm.stats(), finish)))
