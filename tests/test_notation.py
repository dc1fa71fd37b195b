"""One symbol, one meaning: the book's math agrees with the register in notation.md.

notation.md lists every symbol in tables headed "| symbol | meaning | unit | where it first matters |".
The words in bold in a meaning are its keywords; the unit column lists its units. Two rules hold on
the math of every page a reader sees (the markdown of the chapters and labs, intro, glossary,
cheatsheet and notation itself):

1. Every symbol inside $...$ or $$...$$ is in the register. A symbol is a letter or a Greek letter,
   with its subscript if it has one (N_d, t_\\text{math}). An index subscript (x_r, g_i, x_0) counts as
   its letter. Words inside \\text{...} are not symbols.
2. A symbol written alone ($B$) where the text names what it is must be named with the register's
   words. Three ways a text names a symbol are read: the noun just before it ("bus bandwidth $B$"),
   the unit just after it ("$M$ bytes"), and an apposition ("$e$ the share of the peak"). When those
   words are keywords or units of the register but none of the symbol's own, the test fails: that is
   how a page that gives a letter another meaning is caught. Words it cannot place pass unchecked.
"""

import functools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGISTER_HEADER = "| symbol | meaning | unit | where it first matters |"
PAGES = ["intro.md", "glossary.md", "cheatsheet.md", "notation.md", "labs/index.md",
         "chapters/*.ipynb", "labs/*.ipynb"]

GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
         "iota", "kappa", "lambda", "mu", "nu", "xi", "pi", "rho", "sigma", "tau", "upsilon", "phi",
         "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Pi", "Sigma",
         "Upsilon", "Phi", "Psi", "Omega"}
INDEX_SUBSCRIPTS = re.compile(r"[ijr]|\d+")        # x_r, g_i, x_0: an index, not a new symbol
WORD_COMMANDS = ("text", "textbf", "mathrm", "operatorname", "mathbb", "begin", "end")   # {...} holds words
WINDOW = 3                                         # words of an apposition that define a symbol


# ---- reading the pages ----------------------------------------------------------------------

def page_texts():
    """(page name, markdown text) for every page the test reads."""
    for pattern in PAGES:
        for path in sorted(ROOT.glob(pattern)):
            name = str(path.relative_to(ROOT))
            if path.suffix == ".ipynb":
                cells = json.loads(path.read_text())["cells"]
                yield name, "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
            elif path.exists():
                yield name, path.read_text()


def without_code(md):
    """Markdown with code blocks and code spans (glue, doc and term roles included) made blank.

    A fence whose info string is a {directive} (admonition, dropdown, note) holds prose: it stays.
    """
    kept, fences = [], []                  # fences: (backticks, is_code) of the blocks open here
    for line in md.split("\n"):
        m = re.match(r"\s*(`{3,}|~{3,})\s*(\S*)", line)
        if m and fences and m.group(1) == fences[-1][0] and not m.group(2):
            fences.pop()
            kept.append(" | ")
        elif m and not (fences and fences[-1][1]):
            fences.append((m.group(1), not m.group(2).startswith("{")))
            kept.append(" | ")
        else:
            kept.append(" | " if fences and fences[-1][1] else line)
    return re.sub(r"(?:\{[\w:-]+\})?`[^`\n]*`", " | ", "\n".join(kept))


def math_spans(md):
    """(start, end, latex) of every $...$ and $$...$$ outside code."""
    for m in re.finditer(r"\$\$(.+?)\$\$|\$([^$]+?)\$", md, flags=re.S):
        latex = m.group(1) if m.group(1) is not None else m.group(2)
        if "\n\n" not in latex:
            yield m.start(), m.end(), latex


# ---- symbols in LaTeX -----------------------------------------------------------------------

def _group(latex, i):
    """The argument starting at latex[i]: a {...} group, a \\command (with its {...}), or one character."""
    if latex[i] == "{":
        depth = 0
        for j in range(i, len(latex)):
            depth += {"{": 1, "}": -1}.get(latex[j], 0)
            if depth == 0:
                return latex[i + 1:j], j + 1
    m = re.match(r"\\[A-Za-z]+\s*(\{[^{}]*\})?", latex[i:])
    if m:
        return m.group(0), i + m.end()
    return latex[i], i + 1


def _subscript_name(raw):
    """'{os+g+p}' -> 'os+g+p', '\\text{math}' -> 'math', 'd' -> 'd'."""
    raw = re.sub(r"\\(?:text|mathrm)\s*\{([^{}]*)\}", r"\1", raw)
    return re.sub(r"[\s{}]|\\[,;! ]", "", raw)


def symbols(latex):
    """The symbols of a LaTeX formula, in order: 'N', 'N_d', '\\Psi', '\\Psi_root', '\\mathcal{L}'."""
    found, i = [], 0
    while i < len(latex):
        ch = latex[i]
        base = None
        if ch == "\\":
            m = re.match(r"\\mathcal\s*\{([A-Za-z])\}|\\([A-Za-z]+)|\\.", latex[i:])
            i += m.end()
            if m.group(1):
                base = rf"\mathcal{{{m.group(1)}}}"
            elif m.group(2) in GREEK:
                base = "\\" + m.group(2)
            elif m.group(2) in WORD_COMMANDS:
                while i < len(latex) and latex[i] == " ":
                    i += 1
                if i < len(latex) and latex[i] == "{":
                    _, i = _group(latex, i)
            if base is None:
                continue
        elif ch.isalpha():
            base, i = ch, i + 1
        elif ch in "_^":                       # a subscript or exponent on something that is not a symbol
            arg, i = _group(latex, i + 1)
            found += symbols(arg)
            continue
        else:
            i += 1
            continue
        name, in_exponents = base, []
        while i < len(latex) and latex[i] in "_^'":
            if latex[i] == "'":
                i += 1
                continue
            kind = latex[i]
            arg, i = _group(latex, i + 1)
            if kind == "^":
                in_exponents += symbols(arg)   # an exponent: its letters are symbols of their own
            else:
                name = f"{base}_{_subscript_name(arg)}"
        found.append(name)
        found += in_exponents
    return found


def known(name, reg):
    """The register's entry for a symbol: its own, or its letter's when the subscript is an index."""
    if name in reg:
        return name
    base, _, sub = name.partition("_")
    if INDEX_SUBSCRIPTS.fullmatch(sub) and base in reg and (sub.isdigit() or sub in reg):
        return base
    return None


def is_alone(latex):
    """True when the formula is one symbol and nothing else: $B$, $N_d$, $\\theta^{(32)}$."""
    rest = re.sub(r"\\mathcal\s*\{[A-Za-z]\}|\\[A-Za-z]+|[A-Za-z]", "", latex, count=1)
    rest = re.sub(r"_\s*(\{[^{}]*\}|\\text\{[^{}]*\}|\w)|\^\s*\{\(\d+\)\}|\s", "", rest)
    return rest == "" and len(symbols(latex)) == 1


# ---- the register ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def register():
    """{symbol: (meaning, keywords, units)} from notation.md's register tables.

    keywords: the phrases in bold in the meaning; units: the alternatives of the unit column
    ("numbers or tokens" -> {"numbers", "tokens"}; "bytes per second" -> {"bytes"}).
    """
    entries, in_table = {}, False
    for line in (ROOT / "notation.md").read_text().splitlines():
        if line.strip() == REGISTER_HEADER:
            in_table = True
            continue
        if not in_table or not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-", ":"}:
            continue
        meaning, unit = cells[1], cells[2]
        keywords = {tuple(_words(k)) for k in re.findall(r"\*\*([^*]+)\*\*", meaning)}
        units = {_words(u)[0] for u in re.split(r",| or ", unit) if _words(u)}
        for _, _, latex in math_spans(cells[0]):
            (name,) = symbols(latex)
            assert name not in entries, f"notation.md lists ${latex}$ twice"
            entries[name] = (re.sub(r"\*\*", "", meaning), keywords, units)
    return entries


def _words(text):
    return [w.lower().removesuffix("'s").removesuffix("’s") for w in re.findall(r"[A-Za-z][\w/'’-]*", text)]


def _same(word, key):
    return word == key or word in (key + "s", key + "es") or key in (word + "s", word + "es")


def _ends_with(words, phrase):
    """True when the words end with the phrase (its last word singular or plural)."""
    n = len(phrase)
    return len(words) >= n and list(words[-n:-1]) == list(phrase[:-1]) and _same(words[-1], phrase[-1])


def _has(words, phrase):
    return any(_ends_with(words[:i + 1], phrase) for i in range(len(words)))


def _clause(md, start, end):
    """The words of the clause just before and just after a formula (up to punctuation or other math)."""
    stop = r"[.,;()\[\]|!?$]|\n\s*\n"
    before = re.split(stop, md[:start])[-1]
    after = re.split(r"[.;()\[\]|!?$]|\n\s*\n", md[end:])[0]
    return _words(before), after


def _vocabulary(reg):
    """Every keyword and every unit of the register."""
    return (set().union(*(kw for _, kw, _ in reg.values())), set().union(*(u for _, _, u in reg.values())))


def misreading(name, md, start, end, reg):
    """Why a lone symbol reads as another meaning here, or None. Three ways a text defines a symbol:
    a noun just before it ("bus bandwidth $B$"), a unit just after it ("$M$ bytes"), and an
    apposition ("$F$, the chip's FLOP/s", "$c$ the bytes of the compute dtype")."""
    _, own, units = reg[name]
    every_keyword, every_unit = _vocabulary(reg)
    before, after_text = _clause(md, start, end)
    after = _words(after_text.split(",")[0])
    named_by = [k for k in every_keyword if _ends_with(before, k)]
    if named_by and not any(_ends_with(before, k) for k in own):
        return f"'{' '.join(before[-3:])} ${name}$'"
    counted = after[:1] and any(_same(after[0], u) for u in every_unit)
    rate = after[1:2] == ["per"] or before[-2:] == ["multiple", "of"]     # "$T$ FLOPs per byte"
    if counted and not rate and not any(_same(after[0], u) for u in units):
        return f"'${name}$ {after[0]}'"
    m = re.match(r"\s*,?\s*(?:is\s+|be\s+|being\s+)?(?:the|its)\s", after_text)
    if m:
        said = _words(after_text[m.end():])[:WINDOW + 1]
        if any(_has(said, k) for k in every_keyword) and not any(_has(said, k) for k in own):
            return f"'${name}$ {after_text[:m.end()].strip()} {' '.join(said)}'"
    return None


# ---- the checks -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def problems():
    reg = register()
    unknown, misread = [], []
    for page, md in page_texts():
        md = without_code(md)
        for start, end, latex in math_spans(md):
            for name in symbols(latex):
                if known(name, reg) is None:
                    unknown.append(f"{page}: ${name}$ is not in notation.md (in ${' '.join(latex.split())[:60]}$)")
            if not is_alone(latex):
                continue
            name = known(symbols(latex)[0], reg)
            why = name and misreading(name, md, start, end, reg)
            if why:
                misread.append(f"{page}: {why} reads as another meaning; notation.md's ${name}$ is: {reg[name][0]}")
    return tuple(unknown), tuple(misread)


def test_the_register_parses():
    reg = register()
    assert len(reg) > 40
    assert all(keywords for _, keywords, _ in reg.values()), [s for s, (_, k, _) in reg.items() if not k]
    assert reg["\\Psi"][0].startswith("number of model parameters")


def test_symbols_are_read_as_the_register_writes_them():
    assert symbols(r"(2 + 2 + K)\Psi / N_d") == ["K", "\\Psi", "N_d"]
    assert symbols(r"t_\text{math} = C / F_\text{peak}") == ["t_math", "C", "F_peak"]
    assert symbols(r"P_{os+g+p}, x_r, g^{(16)}, \mathcal{L}") == ["P_os+g+p", "x_r", "g", "\\mathcal{L}"]
    reg = register()
    assert [known(s, reg) for s in ("x_r", "x_0", "g_i", "q_8", "m_p", "B", "W")] == ["x", "x", "g", "q_8", None, None, None]
    assert symbols(r"2^{\,e-\text{bias}} \lfloor x \rfloor_q") == ["e", "x", "q"]
    assert symbols(r"\frac{N-1}{N} P q_8") == ["N", "N", "P", "q_8"]
    assert is_alone("B") and is_alone(r"\theta^{(32)}") and is_alone("N_d") and not is_alone("NB")


def test_a_letter_with_two_meanings_is_caught():
    reg = register()
    md = ("at the ring's bus bandwidth $\\beta$ with batch $b$ each; by a scale $S$ now; "
          "it moves $M$ bytes; with $g$ the\nbytes of the reduced gradient; $F$, the achieved rate")
    flagged = [known(symbols(latex)[0], reg) for start, end, latex in math_spans(md)
               if misreading(known(symbols(latex)[0], reg), md, start, end, reg)]
    assert flagged == ["S", "M", "g"]                     # a line break reads as a space


def test_every_symbol_the_book_computes_with_is_in_the_register():
    unknown, _ = problems()
    assert not unknown, f"{len(unknown)} symbols missing from notation.md:\n" + "\n".join(unknown)


def test_every_symbol_is_defined_with_the_register_meaning():
    _, misread = problems()
    assert not misread, f"{len(misread)} symbols defined with another meaning:\n" + "\n".join(misread)
