"""The one exception type that reaches users as a single line (the CLI prints it without a traceback)."""


class UserError(Exception):
    """Bad input from the user: a path, a size, a checkpoint, a sampling value. The message is the whole story."""


class ModelFault(UserError):
    """The model itself failed in a way its input explains (non-finite logits from damaged weights or an overflowing
    dtype): one line, not a traceback; a server answers it with 500, not 400."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (docker stop, systemd, kill), raised where the program is, so it stops as on Ctrl-C: files closed,
    and what can be resumed said (quantize). Loops that take Ctrl-C as "stop this reply" let it through."""
