"""Full-page screenshots of the built book, as a reader's browser shows it.

    python scripts/screenshots.py                       # _build/html -> _build/screenshots
    python scripts/screenshots.py --out /tmp/shots chapters/05_ddp.html

Serves the built site on 127.0.0.1 (a free port; nothing leaves the machine) and photographs the
intro, every chapter and the back matter with headless Chromium (Debian: apt-get install chromium),
1280 pixels wide, after MathJax has typeset the page. Each page gives NAME.png (the whole page) and
NAME-1.png, NAME-2.png, ... (the same page cut into screen-sized parts, easier to read one by one).

Chromium takes a screenshot of its window only, so each page is loaded twice: once to measure its
height (a small script, added to the served copy only, writes it into the title), once in a window
that tall. Pages taller than Chromium's limit are shot in parts by scrolling and stitched together.
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
MAX_SHOT = 15000        # pixels: taller windows come back blank or cut in headless Chromium
PART = 2400             # height of each readable part
BUDGET_MS = "15000"     # virtual time Chromium gives a page to load fonts and run MathJax

# Added before </body> of the served copy only. Waits for MathJax, then says how tall the page is
# (?zl-measure) or scrolls to a given offset (?zl-scroll=Y).
PROBE = """<script>addEventListener("load", () => {
  const q = new URLSearchParams(location.search);
  const act = () => {
    if (q.has("zl-measure")) document.title = "zl-height:" + document.documentElement.scrollHeight;
    if (q.has("zl-scroll")) window.scrollTo(0, Number(q.get("zl-scroll")));
  };
  const mj = window.MathJax && MathJax.startup && MathJax.startup.promise;
  (mj ? mj.then(() => setTimeout(act, 300)) : setTimeout(act, 300));
});</script>"""


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site; HTML asked for with ?zl-... gets the probe script."""

    def log_message(self, *args):
        pass

    def send_head(self):
        if "?zl-" not in self.path or not self.path.split("?")[0].endswith(".html"):
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


def shoot(url: str, height: int, png: Path, scroll: int | None = None):
    query = "" if scroll is None else f"?zl-scroll={scroll}"
    run_chromium([f"--window-size={WIDTH},{height}", f"--screenshot={png}", url + query])
    if not png.exists():
        raise RuntimeError(f"Chromium wrote no screenshot of {url}")


def photograph(url: str, stem: Path) -> tuple[int, int]:
    """Write stem.png (whole page) and stem-1.png, stem-2.png, ... (parts); return (height, parts)."""
    height = page_height(url)
    whole = stem.with_suffix(".png")
    if height <= MAX_SHOT:
        shoot(url, height, whole)
        image = Image.open(whole)
    else:   # scroll window by window and stitch (the last window scrolls only to the bottom)
        image = Image.new("RGB", (WIDTH, height), "white")
        for top in range(0, height, MAX_SHOT):
            part = stem.parent / f"{stem.name}-scroll.png"
            shoot(url, MAX_SHOT, part, scroll=top)
            shot = Image.open(part)
            offset = min(top, height - MAX_SHOT)      # where the browser really scrolled to
            image.paste(shot.crop((0, top - offset, WIDTH, shot.height)), (0, top))
            part.unlink()
        image.save(whole)
    parts = 0
    for parts, top in enumerate(range(0, image.height, PART), start=1):
        image.crop((0, top, image.width, min(top + PART, image.height))).save(stem.parent / f"{stem.name}-{parts}.png")
    return height, parts


def default_pages(site: Path) -> list[str]:
    chapters = sorted(str(p.relative_to(site)) for p in (site / "chapters").glob("*.html"))
    back = [name for name in ("notation.html", "glossary.html", "references.html") if (site / name).exists()]
    return ["intro.html" if (site / "intro.html").exists() else "index.html", *chapters, *back]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", help="pages relative to the site (default: intro, chapters, back matter)")
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
            height, parts = photograph(url, out / Path(page).with_suffix("").name)
            print(f"{page}: {height} px, {parts} parts -> {out / Path(page).with_suffix('.png').name}")
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
