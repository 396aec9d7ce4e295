"""Error types that carry a message meant for the user.

Every error raised because of user input (a flag, a model path, a request field) is an
:class:`FwError` whose message says what was wrong and what is valid. Internal invariants use
``assert``.
"""


class FwError(Exception):
    """Base class for errors whose message is shown to the user as is."""


class ConfigError(FwError, ValueError):
    """A setting, flag or argument has a value fw cannot use."""


def brief(error: BaseException) -> str:
    """``"TypeName: first line of the message"``: a library's exception, short enough to quote
    inside fw's own message (torch and FlashInfer errors run to many lines)."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class GrammarError(ConfigError):
    """A request's structured-output constraint is invalid or failed to compile. The message starts
    with the constraint's kind (``structured_outputs.<kind>: ...``); the server answers with a 400
    naming the request field the constraint came from."""


class RequestFailedError(FwError):
    """The engine gave up a valid request because a step it was part of failed (``out_of_memory``:
    the device ran out of memory; else an internal error, logged by the engine). Retrying may
    succeed; the server answers 503 for the first and 500 for the second."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


class UnknownNameError(ConfigError, KeyError):
    """A name was looked up in a registry that does not hold it; the message lists valid names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateNameError(FwError):
    """Two plugins registered the same name in one registry; the message names both."""


class PluginError(FwError):
    """A plugin could not be loaded or implements a hook wrongly; the message names it."""


class ModelLoadError(FwError):
    """A model could not be found or read; the message names the source and the cause."""
