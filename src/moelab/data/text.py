"""Pure text functions: decode bytes, normalize text, strip roff markup from man pages.

They take and return plain values (no I/O, no state), so any engine (multiprocessing
here, Ray Data across machines) can map them over documents.
"""

from __future__ import annotations

import re
import unicodedata

# A file whose bytes are mostly UTF-8 keeps its text with U+FFFD for the few bad bytes
# (old Latin-1 changelogs have one accented name); above this share it is not UTF-8 text.
MAX_REPLACED_FRACTION = 0.01


def decode(data: bytes) -> tuple[str | None, str]:
    """Return (text, note); text is None when the bytes are not text.

    The note goes into the manifest: "" for valid UTF-8, "utf8_replaced:N" when N bad
    bytes became U+FFFD, "binary" (a NUL byte, as git decides) or "not_utf8".
    """
    if b"\0" in data:
        return None, "binary"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd")
    if replaced > MAX_REPLACED_FRACTION * len(text):
        return None, "not_utf8"
    return text, f"utf8_replaced:{replaced}"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufeff]")  # keeps \t and \n
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")


def normalize(text: str) -> str:
    """One spelling per text (NFC, \\n line ends, no control bytes or trailing blanks),
    so exact-duplicate hashing sees through CRLF and Unicode-composition differences."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", unicodedata.normalize("NFC", text))
    text = _TRAILING_SPACE.sub("", text)
    return _BLANK_RUNS.sub("\n\n", text).strip("\n")


_MAN_PAGE = re.compile(r"\.[1-9][a-z]*(\.gz)?$")


def is_man_page(path: str) -> bool:
    """Man pages are named by section: ls.1.gz, CA.pl.1ssl.gz, printf.3.gz."""
    return bool(_MAN_PAGE.search(path))


# Roff requests (.de, .if, .ft, ...) are lower case and carry no text; man and mdoc
# macros (.SH, .B, .Nm, ...) are capitalized and their arguments are the text, except
# these, which carry titles, index entries or layout.
_ROFF_LAYOUT_MACROS = {"TH", "Dd", "Dt", "Os", "IX", "Vb", "Ve", "Sp", "PD", "RS", "RE"}
# Alternating-font macros (.BR ls (1)) join their arguments without spaces.
_ROFF_ALTERNATING = {"BR", "BI", "IB", "IR", "RB", "RI"}
_ROFF_ARG = re.compile(r'"[^"]*"|\S+')
_ROFF_GLYPHS = {"em": "\u2014", "en": "\u2013", "aq": "'", "dq": '"', "lq": '"', "rq": '"',
                "oq": "'", "cq": "'", "bu": "\u2022", "co": "\u00a9", "hy": "-", "mi": "-"}
_ROFF_ESCAPE = re.compile(
    r"\\(?:f(?:\[[^\]]*\]|\(..|.)"  # font change
    r"|s[+-]?\d+"  # size change
    r"|\*(?:\[[^\]]*\]|\(..|.)"  # string interpolation
    r"|\((?P<glyph2>..)|\[(?P<glyph>[^\]]*)\]"  # named glyph
    r"|(?P<char>.))",  # anything else, including a line-continuing newline
    re.DOTALL,
)
_ROFF_CHARS = {"-": "-", "e": "\\", " ": " ", "0": " ", "~": " "}  # others print nothing


def _roff_escape(match: re.Match[str]) -> str:
    glyph = match["glyph2"] or match["glyph"]
    if glyph is not None:
        return _ROFF_GLYPHS.get(glyph, "")
    return _ROFF_CHARS.get(match["char"] or "", "")


def _roff_macro_text(macro: str, args: str) -> str | None:
    if not macro[:1].isupper() or macro in _ROFF_LAYOUT_MACROS:
        return None
    words = [w.strip('"') for w in _ROFF_ARG.findall(args) if not w.isdigit()]
    return ("" if macro in _ROFF_ALTERNATING else " ").join(words)


def strip_roff(text: str) -> str:
    """Readable text from a man page: macro arguments and body lines, escapes resolved.

    Reasonable, not exact: good enough that the tokenizer learns English, not groff.
    """
    lines: list[str] = []
    in_definition = False  # inside .de ... .. (a macro definition)
    for line in text.splitlines():
        if in_definition:
            in_definition = line.strip() != ".."
        elif line.startswith((".", "'")):
            macro, _, args = line[1:].strip().partition(" ")
            in_definition = macro == "de"
            kept = _roff_macro_text(macro, args)
            if kept is not None:
                lines.append(kept)
        else:
            lines.append(line)
    return _ROFF_ESCAPE.sub(_roff_escape, "\n".join(lines))
