"""The grammar of monarch_dsl's compact text (meshes, plans), in one file: ``plan.lark``.

lark is imported only when a parser is first asked for, so importing monarch_dsl stays light.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lark

GRAMMAR_PATH = Path(__file__).with_name("plan.lark")

# How the grammar's terminals read in error messages ("expected a name, found ',' ...").
_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "$END": "end of input",
    "SIGNED_INT": "an integer",
    "FLOAT": "a float",
    "STRING": "a string",
    "VAR": "a %value",
    "DOTTED": "an op name",
    "OPSTRING": "a quoted op name",
    "LOC": "a file:line",
    "LABEL": "a mesh dim label (dp:)",
    "TORCH": "a torch value (torch.float32)",
}


@functools.cache
def parser(start: str) -> lark.Lark:
    """An LALR parser of ``plan.lark`` whose start rule is ``start`` (e.g. ``"mesh"``); cached."""
    import lark

    return lark.Lark(GRAMMAR_PATH.read_text(), parser="lalr", start=start)


def explain(error: Exception, text: str, start: str) -> str:
    """Say where and why ``text`` failed to parse as ``start``, given lark's exception.

    Gives e.g. ``at column 5: expected a name, found ','`` followed by the text with a caret.
    """
    import lark.exceptions as lx

    grammar = parser(start)

    def word(terminal: str) -> str:
        if terminal in _TERMINAL_WORDS:
            return _TERMINAL_WORDS[terminal]
        try:
            pattern = grammar.get_terminal(terminal).pattern
        except KeyError:
            return terminal
        return repr(pattern.value) if pattern.type == "str" else terminal

    if isinstance(error, lx.UnexpectedToken):
        found = word("$END") if error.token.type == "$END" else repr(str(error.token))
        expected = error.expected
    elif isinstance(error, lx.UnexpectedCharacters):
        found, expected = repr(error.char), error.allowed or set()
    elif isinstance(error, lx.UnexpectedEOF):
        found, expected = word("$END"), set(error.expected)
    else:
        return str(error)
    wanted = " or ".join(sorted(word(t) for t in expected)) or "nothing more"
    line, column = getattr(error, "line", -1), getattr(error, "column", -1)
    if column in (None, -1):
        return f"at end of input: expected {wanted}, found {found}"
    one_line = line == 1 and "\n" not in text.strip()
    where = f"at column {column}" if one_line else f"at line {line}, column {column}"
    context = error.get_context(text).rstrip("\n") if text else ""
    return f"{where}: expected {wanted}, found {found}" + (f"\n{context}" if context else "")
