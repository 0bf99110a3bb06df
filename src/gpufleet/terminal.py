"""What others wrote, made safe to print at a terminal.

Job names, worker names, labels, errors and a job's output lines come from other users
and their code, and a terminal obeys the control characters in what it prints: an OSC
sequence sets the window title or writes the clipboard (OSC 52), a CSI sequence clears
the screen or moves the cursor, a DCS one talks to the terminal itself, and the bidi
controls make text read other than it is. The CLI shows these characters as visible
escapes (the four characters ``\\x1b`` for an ESC, ``\\u202e`` for a right-to-left
override) instead of sending them:

- :func:`visible` for names, labels, ids, messages and table cells: every control
  character escaped;
- :func:`for_terminal` for a job's output lines (``gpufleet logs``): its colours (SGR
  sequences), carriage returns (progress bars redrawn in place) and tabs kept, every
  other control escaped.

The worker's log (its terminal, or the journal an operator reads) shows job names
through :func:`visible` too. Only the standard library here: the CLI's root imports
this module for its errors.
"""

from __future__ import annotations

import functools
import re

#: C0 controls, DEL, C1 controls (0x9b is a CSI of its own), the bidi controls (marks,
#: embeddings, overrides, isolates), the line and paragraph separators, and lone
#: surrogates (which no terminal encoding can write).
CONTROL = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
# Patterns as text, compiled on first use: a command that prints nothing of others'
# (``gpufleet --help``) does not pay for compiling them.
_CONTROL = f"[{CONTROL}]"
#: a colour or text style: ESC [ digits and semicolons m, and nothing else
_SGR = "\x1b\\[[0-9;]*m"
#: in an output line: a colour, a kept control, or one to escape
_OUTPUT = f"({_SGR})|[\t\r]|[{CONTROL}]"
_RESETS = ("\x1b[m", "\x1b[0m")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _escaped(char: str) -> str:
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def visible(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``, ``\\n``,
    ``\\u202e``): a name or message prints as the characters it holds, on one line, and
    does nothing to the terminal."""
    return _compiled(_CONTROL).sub(lambda m: _escaped(m.group()), text)


def for_terminal(line: str) -> str:
    """A job's output line as a terminal may show it: colours (SGR), carriage returns
    and tabs kept, every other control shown as an escape. A line that leaves a colour
    on ends with a reset, so a job's colours never reach the next line or the CLI's own
    words."""
    if not _compiled(_CONTROL).search(line):
        return line  # most lines: nothing to keep or escape
    last = ""

    def kept_or_escaped(m: re.Match[str]) -> str:
        nonlocal last
        if m.group(1):
            last = m.group(1)
            return last
        found = m.group()
        return found if found in "\t\r" else _escaped(found)

    shown = _compiled(_OUTPUT).sub(kept_or_escaped, line)
    return shown + "\x1b[0m" if last and last not in _RESETS else shown


__all__ = ["CONTROL", "for_terminal", "visible"]
