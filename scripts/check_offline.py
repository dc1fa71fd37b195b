"""Check that the built book loads nothing from another host: python scripts/check_offline.py _build/html

A reader may open the book with no network (or behind a firewall): every script, style sheet, font
and image a page loads must come from the site itself. Links a reader clicks (<a href>, a paper's
page) may point anywhere. MathJax in particular must be the copy under _static/mathjax.
Exits 1 and lists every page and address that breaks this.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# What a browser fetches by itself: <script src>, <link href> (style sheets, fonts, icons), <img src>,
# <iframe src>, <source src>, and url(...) in inline styles. An address with a scheme or starting
# with // is on another host.
LOADS = re.compile(r"""<(?:script|img|iframe|source|audio|video)\b[^>]*?\bsrc\s*=\s*["']([^"']+)["']"""
                   r"""|<link\b[^>]*?\bhref\s*=\s*["']([^"']+)["']"""
                   r"""|url\(\s*["']?([^"')]+)""", re.I)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)
# <link rel="canonical"> and friends name a page; the browser does not fetch them
NOT_FETCHED = re.compile(r"""<link\b[^>]*\brel\s*=\s*["'](?:canonical|alternate|author|license|search)["']""", re.I)


def external_loads(page: str) -> list[str]:
    found = []
    for m in LOADS.finditer(page):
        address = next(g for g in m.groups() if g)
        tag_start = page.rfind("<", 0, m.end())
        if m.group(2) and NOT_FETCHED.match(page, tag_start):
            continue
        if EXTERNAL.match(address.strip()):
            found.append(address.strip())
    return found


def main(root: str) -> int:
    site = Path(root)
    pages = sorted(site.rglob("*.html"))
    if not pages:
        print(f"check_offline: no HTML under {site}: build the book first (make book)")
        return 1
    problems = {str(p.relative_to(site)): external_loads(p.read_text(encoding="utf-8", errors="replace"))
                for p in pages}
    problems = {page: found for page, found in problems.items() if found}
    mathjax = site / "_static" / "mathjax" / "tex-chtml.js"
    if not mathjax.exists():
        problems["_static/mathjax"] = ["tex-chtml.js is missing: is sphinx-mathjax-offline installed?"]
    for page, found in problems.items():
        for address in sorted(set(found)):
            print(f"{page}: loads {address}")
    if problems:
        return 1
    print(f"check_offline: {len(pages)} pages load nothing from another host; MathJax is served from "
          f"{mathjax.relative_to(site)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "_build/html"))
