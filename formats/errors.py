"""NibbleError, which user-facing layers turn into a clean message, and its kinds."""
import re

# What str.splitlines breaks at: a value quoted in a message (a path, an option, a tensor's name
# from a damaged file) may hold them.
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def one_line(text: str) -> str:
    """`text` with its line breaks written as escapes (\\n): a message is one line."""
    return _LINE_BREAKS.sub(lambda m: repr(m[0])[1:-1], text)


class NibbleError(Exception):
    """Bad input or an unmet requirement. The message says what is wrong and what to do, in one
    line whatever the names it quotes hold."""

    def __str__(self):
        return one_line(super().__str__())


class FormatError(NibbleError):
    """A model file or directory that cannot be read."""


class UnsupportedModel(NibbleError):
    """A model that a set of kernels cannot run (a shape, a mix of quantizations): the message
    says what and what to do; the model may still run on other kernels (the GPU's on the CPU)."""
