"""`dsv3lite chat` in a real terminal (a pseudo-terminal): readline editing with the arrow keys, history within a
chat (Up) and across runs (the history file under HOME)."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

LEFT, UP = "\x1b[D", "\x1b[A"


class Terminal:
    """A child process on a pseudo-terminal (24 x `columns`); `expect` reads its output until a string shows up."""

    def __init__(self, argv, env, columns: int = 100):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.seen and time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            try:
                self.seen += os.read(self.master, 65536).decode(errors="replace")
            except OSError:                      # the child closed the terminal
                break
        assert text in self.seen, f"{text!r} did not appear; the terminal shows:\n{self.seen[-2000:]}"

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        """Wait for the child to exit (reading what it still prints) -> its exit status."""
        try:
            self.expect("\0never printed\0", timeout=30) if self.proc.poll() is None else None
        except AssertionError:
            pass
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the chat did not exit; the terminal shows:\n{self.seen[-2000:]}") from None
        finally:
            os.close(self.master)


@pytest.fixture()
def chat(v3_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DSV3LITE_HISTORY"}
    env.update(HOME=str(tmp_path), TERM="xterm", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "dsv3lite.cli", "chat", "-w", str(v3_dir), "--device", "cpu", "-c", "64"]
    return lambda: Terminal(argv, env)


def test_chat_line_editing_and_history(chat, tmp_path):
    history = tmp_path / ".dsv3lite_history"
    history.write_text("/fromfile\n")             # what an earlier chat left
    prompt = " (/help lists them)\r\n>>> "       # keys go only to a fresh prompt (readline's)
    term = chat()
    term.expect(">>> ")
    term.send(f"{UP}\r")                         # Up recalls the earlier chat's line
    term.expect("unknown command /fromfile" + prompt)
    term.send(f"/abc{LEFT}X\r")                  # Left moves the cursor: the line sent is /abXc
    term.expect("unknown command /abXc" + prompt)
    term.seen = ""
    term.send(f"{UP}\r")                         # Up recalls this chat's previous line
    term.expect("unknown command /abXc" + prompt)
    term.send("\x04")                            # Ctrl-D leaves
    assert term.close() == 0
    lines = history.read_text().splitlines()
    assert "/fromfile" in lines and "/abXc" in lines and not any("[D" in l for l in lines)


def test_a_multi_line_message_is_one_history_entry(chat, tmp_path):
    history = tmp_path / ".dsv3lite_history"
    after_reply = "tok/s"                             # the stats line, then a fresh prompt takes keys
    term = chat()
    term.expect(">>> ")
    for line in ('"""', "first line"):
        term.send(line + "\r")
        term.expect("... ")
        term.seen = ""
    term.send('second line"""\r')
    term.expect(after_reply)
    prompt_tokens = term.seen.split(" prompt tok")[0].split()[-1]
    term.expect(">>> ")
    term.send("\x04")
    assert term.close() == 0
    assert history.read_text().splitlines() == ['"""first line\\nsecond line"""']
    term = chat()                                     # the next chat recalls it as one message with Up
    term.expect(">>> ")
    term.seen = ""
    term.send(f"{UP}\r")
    term.expect(after_reply)
    term.expect(">>> ")
    term.send("\x04")
    assert term.close() == 0
    assert "... " not in term.seen and f"{prompt_tokens} prompt tok" in term.seen     # sent whole: no continuation prompt
    assert history.read_text().splitlines() == ['"""first line\\nsecond line"""']   # readline keeps no repeat
