"""Pure per-document functions: decoding, normalization, roff stripping, signatures."""

import numpy as np

from moelab.data.dedup import NUM_PERM, signature
from moelab.data.text import decode, is_man_page, normalize, strip_roff


def test_decode_keeps_utf8_repairs_a_few_bad_bytes_and_rejects_the_rest():
    assert decode("héllo".encode()) == ("héllo", "")
    text, note = decode(b"caf\xe9 " + b"plain ascii text " * 20)
    assert note == "utf8_replaced:1" and text.startswith("caf\ufffd ")
    assert decode(bytes(range(128, 256)) * 4) == (None, "not_utf8")
    assert decode(b"ELF\x00\x01\x02") == (None, "binary")


def test_normalize_gives_one_spelling_per_text():
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert normalize(decomposed) == composed
    assert normalize("\ufeffa  \r\nb\t\r\n\r\n\r\n\r\nc\x1b[0m\n") == "a\nb\n\nc[0m"


def test_strip_roff_keeps_the_words_and_drops_the_markup():
    page = "\n".join([
        '.\\" a comment',
        ".de Xx",
        "defined macro body",
        "..",
        '.TH LS 1 "2023" "GNU"',
        ".SH NAME",
        "ls \\- list directory contents",
        ".SH DESCRIPTION",
        ".B ls",
        "prints \\fBfiles\\fR and \\fIdirectories\\fP\\(em sorted.",
        ".BR dir (1)",
        ".IP \\(bu 4",
        ".ft CW",
    ])
    assert strip_roff(page).splitlines() == [
        "NAME", "ls - list directory contents", "DESCRIPTION", "ls",
        "prints files and directories\u2014 sorted.", "dir(1)", "\u2022",
    ]
    assert is_man_page("/usr/share/man/man1/ls.1.gz") and is_man_page("x/CA.pl.1ssl.gz")
    assert not is_man_page("/usr/share/doc/bash/README.gz")


def test_signature_is_deterministic_and_tracks_similarity():
    words = [f"w{i}" for i in range(300)]
    base = " ".join(words)
    edited = " ".join(words[:150] + ["changed"] + words[151:])
    other = " ".join(reversed(words))
    a, b, c = signature(base), signature(edited), signature(other)
    assert a.shape == (NUM_PERM,) and np.array_equal(a, signature(base))
    assert np.mean(a == b) > 0.9 > 0.1 > np.mean(a == c)
