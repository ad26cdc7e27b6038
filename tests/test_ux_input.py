"""Input that must not end a session: a terminal chat that outgrows its context, a message too long for it, bytes
that are not UTF-8 on stdin, keys typed while a reply streams, and a multi-line message in the history."""
from __future__ import annotations

import io
import os
import pty
import sys
import termios

import pytest

import dsv3lite
from dsv3lite.chat_repl import fit_conversation, keys_unechoed
from dsv3lite.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def run(capsys, monkeypatch, stdin: bytes, *args):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8", errors="surrogateescape"))
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def stats_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if " prompt tok" in line and "tok/s" in line]


def test_chat_keeps_the_session_when_the_context_fills(capsys, monkeypatch, v3_dir):
    messages = b"".join(b"message number %d with a few words\n" % i for i in range(5))
    rc, out, err = run(capsys, monkeypatch, messages, "chat", "-w", v3_dir, "-c", "64", "-m", "20", "--temp", "0")
    assert rc == 0, err
    assert len(stats_lines(err)) == 5                          # every message answered
    assert "error" not in err
    notes = [line for line in err.splitlines() if "outgrew the 64-token context" in line]
    assert notes and all("dropped its oldest" in n for n in notes)


def test_a_message_longer_than_the_context_is_one_line_and_the_chat_goes_on(capsys, monkeypatch, v3_dir):
    rc, out, err = run(capsys, monkeypatch, b"word " * 80 + b"\nhello\n", "chat", "-w", v3_dir, "-c", "64", "-m", "4")
    assert rc == 0, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "context holds 64" in errors[0] and "Traceback" not in err
    assert len(stats_lines(err)) == 1                          # the next message is answered


def test_fit_conversation_drops_whole_exchanges_and_keeps_the_system_prompt(v3_dir):
    tok = dsv3lite.load(v3_dir, device="cpu", progress=False, log=lambda m: None).tokenizer
    chat = [{"role": "system", "content": "be brief"}]
    for i in range(6):
        chat += [{"role": "user", "content": f"question {i} " * 3}, {"role": "assistant", "content": f"answer {i} " * 3}]
    chat.append({"role": "user", "content": "last question"})
    full = len(tok.encode_chat(chat))
    kept = list(chat)
    ids, dropped = fit_conversation(tok, kept, 1, full - 10, 5)
    assert len(ids) + 5 <= full - 10 and ids == tok.encode_chat(kept)
    assert dropped % 2 == 0 and dropped == len(chat) - len(kept) > 0
    assert kept[0] == chat[0] and kept[1]["role"] == "user" and kept[-1] == chat[-1]
    assert kept[1:] == chat[1 + dropped:]                       # the oldest exchanges went, in order
    unchanged = list(chat)
    assert fit_conversation(tok, unchanged, 1, full + 5, 5) == (tok.encode_chat(chat), 0) and unchanged == chat


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bytes_that_are_not_utf8_are_replaced_with_a_note(capsys, monkeypatch, v3_dir, command):
    args = ["generate", "-p", "-"] if command == "generate" else ["chat"]
    rc, out, err = run(capsys, monkeypatch, b"hello \xff\xfe there\n", *args, "-w", v3_dir, "-m", "3")
    assert rc == 0, err
    assert "2 bytes that are not UTF-8: replaced with U+FFFD" in err and "Error" not in err
    assert len(stats_lines(err)) == 1


def test_the_tokenizer_takes_lone_surrogates(v3_dir):
    tok = dsv3lite.load(v3_dir, device="cpu", progress=False, log=lambda m: None).tokenizer
    assert tok.encode("a\ud800b\udcff") == tok.encode("a\ufffdb\ufffd")


def test_keys_typed_while_a_reply_streams_are_not_echoed_nor_kept(monkeypatch):
    master, slave = pty.openpty()
    try:
        terminal = os.fdopen(slave, "r", closefd=False)
        monkeypatch.setattr(sys, "stdin", terminal)
        with keys_unechoed():
            os.write(master, b"\x1b[A\x1b[A")                  # Up, Up while the reply streams
            assert not termios.tcgetattr(slave)[3] & termios.ECHO
            os.set_blocking(master, False)
            with pytest.raises(BlockingIOError):
                os.read(master, 100)                           # nothing echoed to the screen
        assert termios.tcgetattr(slave)[3] & termios.ECHO       # echo is back for the next prompt
        os.set_blocking(slave, False)
        with pytest.raises(BlockingIOError):
            os.read(slave, 100)                                # and the keys were not left for it
    finally:
        os.close(master)
        os.close(slave)


def test_sigterm_ends_the_chat_not_just_the_line(capsys, monkeypatch, v3_dir):
    """Ctrl-C at the prompt keeps the chat (a note); SIGTERM (kill, docker stop) ends it: 143, one line."""
    import signal
    import time

    from dsv3lite import chat_repl

    def terminated(editing):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the chat")
    monkeypatch.setattr(chat_repl, "read_message", terminated)
    rc, out, err = run(capsys, monkeypatch, b"", "chat", "-w", v3_dir)
    assert rc == 143 and err.strip().splitlines()[-1] == "terminated (SIGTERM)"
