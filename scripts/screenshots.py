"""Full-page screenshots of the built book, as a reader's browser shows it.

    python scripts/screenshots.py                       # _build/html -> _build/screenshots
    python scripts/screenshots.py --out /tmp/shots chapters/05_ddp.html

Serves the built site on 127.0.0.1 (a free port; nothing leaves the machine) and photographs the
intro, every chapter, the labs and the back matter with headless Chromium (Debian: apt-get install
chromium), 1280 pixels wide, after MathJax has typeset the page. Each page gives NAME.png (the whole
page) and NAME-1.png, NAME-2.png, ... (the same page cut into screen-sized parts, easier to read one
by one). NAME is the page's file name for a chapter or the back matter (05_ddp, glossary), and
prefixed with its folder for the labs (labs-index, labs-03_ddp).

Chromium takes a screenshot of its window only, so each page is loaded twice: once to measure its
height (a small script, added to the served copy only, writes it into the title), once in a window
that tall. A page taller than MAX_SHOT pixels is cut there, and the script says so.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from PIL import Image

WIDTH = 1280
MAX_SHOT = 32000        # pixels: the tallest window checked to come back whole from headless Chromium
PART = 2400             # height of each readable part
BUDGET_MS = "15000"     # virtual time Chromium gives a page to load fonts and run MathJax

# Added before </body> of the copy served for ?zl-measure only: waits for MathJax to typeset the
# page (which changes its height), then writes the height into the title.
PROBE = """<script>addEventListener("load", () => {
  const act = () => { document.title = "zl-height:" + document.documentElement.scrollHeight; };
  const mj = window.MathJax && MathJax.startup && MathJax.startup.promise;
  (mj ? mj.then(() => setTimeout(act, 300)) : setTimeout(act, 300));
});</script>"""


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site; a page asked for with ?zl-measure gets the probe script."""

    def log_message(self, *args):
        pass

    def send_head(self):
        if "?zl-measure" not in self.path or not self.path.split("?")[0].endswith(".html"):
            return super().send_head()
        page = Path(self.translate_path(self.path.split("?")[0]))
        body = page.read_bytes().replace(b"</body>", PROBE.encode() + b"</body>", 1)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    sys.exit("screenshots: no Chromium found (Debian: apt-get install -y chromium)")


def run_chromium(args: list[str]) -> str:
    with tempfile.TemporaryDirectory(prefix="zl-chromium-") as profile:
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", f"--virtual-time-budget={BUDGET_MS}", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    return done.stdout


def page_height(url: str) -> int:
    dom = run_chromium([f"--window-size={WIDTH},1000", "--dump-dom", url + "?zl-measure"])
    m = re.search(r"<title>zl-height:(\d+)</title>", dom)
    if not m:
        raise RuntimeError(f"could not measure {url}: the page did not finish loading")
    return int(m.group(1))


def photograph(url: str, stem: Path) -> tuple[int, int]:
    """Write stem.png (whole page) and stem-1.png, stem-2.png, ... (parts); return (height, parts)."""
    height = page_height(url)
    whole = stem.with_suffix(".png")
    if height > MAX_SHOT:
        print(f"{url}: {height} px tall, shot down to {MAX_SHOT} px only")
    whole.unlink(missing_ok=True)
    run_chromium([f"--window-size={WIDTH},{min(height, MAX_SHOT)}", f"--screenshot={whole}", url])
    if not whole.exists():
        raise RuntimeError(f"Chromium wrote no screenshot of {url}")
    image = Image.open(whole)
    parts = 0
    for parts, top in enumerate(range(0, image.height, PART), start=1):
        image.crop((0, top, image.width, min(top + PART, image.height))).save(stem.parent / f"{stem.name}-{parts}.png")
    return height, parts


def default_pages(site: Path) -> list[str]:
    chapters = sorted(str(p.relative_to(site)) for p in (site / "chapters").glob("*.html"))
    # the labs' index first, then the labs in their order
    labs = sorted((str(p.relative_to(site)) for p in (site / "labs").glob("*.html")),
                  key=lambda page: (not page.endswith("/index.html"), page))
    back = [name for name in ("cheatsheet.html", "notation.html", "glossary.html", "references.html") if (site / name).exists()]
    return ["intro.html" if (site / "intro.html").exists() else "index.html", *chapters, *labs, *back]


def stem(page: str) -> str:
    """The PNGs' name for a page: its file name, prefixed with its folder unless it is a chapter."""
    parts = Path(page).with_suffix("").parts
    return parts[-1] if len(parts) == 1 or parts[0] == "chapters" else "-".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", help="pages relative to the site (default: intro, chapters, labs, back matter)")
    ap.add_argument("--site", default="_build/html", help="the built book (default: %(default)s)")
    ap.add_argument("--out", default="_build/screenshots", help="where the PNGs go (default: %(default)s)")
    args = ap.parse_args(argv)
    site, out = Path(args.site).resolve(), Path(args.out)
    if not (site / "index.html").exists():
        sys.exit(f"screenshots: no built book in {site}: run make book first")
    out.mkdir(parents=True, exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for page in args.pages or default_pages(site):
            url = f"http://127.0.0.1:{server.server_address[1]}/{page}"
            height, parts = photograph(url, out / stem(page))
            print(f"{page}: {height} px, {parts} parts -> {out / (stem(page) + '.png')}")
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
