"""The one exception type that reaches users as a single line (the CLI prints it without a traceback)."""


class UserError(Exception):
    """Bad input from the user: a path, a size, a checkpoint, a sampling value. The message is the whole story."""
