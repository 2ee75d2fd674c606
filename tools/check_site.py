"""Check the built docs site in a real browser: nothing may scroll sideways at a given width.

    python tools/check_site.py [--site site] [--width 1400] [--screenshots DIR]

Each page of the built site (``make docs`` writes ``site/``) is opened in headless Chromium
(Debian's ``chromium`` package, or ``$CHROMIUM``) from disk, at ``--width`` pixels. A script
added to a copy of the page reports, once the page has loaded:

* how far the page scrolls sideways (it must not at all);
* every table, code block or other box in the page's content that scrolls or clips sideways
  (each one fails the check: split the table, shorten the line);
* every image shown at less than 60 % of its own width (its text would be too small to read).

With ``--screenshots DIR`` it also saves a screenshot of each page (the first ``--height``
pixels), to look at. Exit status: 0 when every page passes, 1 otherwise, 2 without Chromium.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPORT_ID = "site-check-report"

# Runs in the page once it has loaded, and leaves its findings, as JSON, in a hidden element
# that --dump-dom then prints with the rest of the page.
PROBE = """
<script>
(function () {
  function run() {
    var root = document.documentElement;
    var width = root.clientWidth;
    var report = {width: width, page_overflow: root.scrollWidth - width, clipped: [], small: []};
    var boxes = document.querySelectorAll(
      ".md-content table, .md-content pre, .md-content .md-typeset__scrollwrap, " +
      ".md-content .highlight, .md-content pre > code, .md-content .doc-signature"
    );
    boxes.forEach(function (el) {
      var over = el.scrollWidth - el.clientWidth;
      if (over > 1) {
        report.clipped.push({tag: el.tagName.toLowerCase(), over: over,
                             text: (el.innerText || "").trim().slice(0, 70)});
      }
    });
    document.querySelectorAll(".md-content img").forEach(function (img) {
      if (img.naturalWidth > 0 && img.clientWidth < 0.6 * img.naturalWidth) {
        report.small.push({src: img.getAttribute("src"), shown: img.clientWidth,
                           natural: img.naturalWidth});
      }
    });
    var out = document.createElement("pre");
    out.id = "REPORT_ID";
    out.hidden = true;
    out.textContent = JSON.stringify(report);
    document.body.appendChild(out);
  }
  if (document.readyState === "complete") { run(); } else { addEventListener("load", run); }
})();
</script>
""".replace("REPORT_ID", REPORT_ID)

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--allow-file-access-from-files",
]


@dataclass
class PageReport:
    page: str
    page_overflow: int = 0
    clipped: list[dict[str, object]] = field(default_factory=list)
    small: list[dict[str, object]] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.page_overflow <= 0 and not self.clipped and not self.small

    def lines(self) -> list[str]:
        if self.error:
            return [f"FAIL  {self.page}: {self.error}"]
        if self.ok:
            return [f"ok    {self.page}"]
        out = [f"FAIL  {self.page}"]
        if self.page_overflow > 0:
            out.append(f"        the page scrolls sideways by {self.page_overflow} px")
        out += [
            f"        a <{c['tag']}> is {c['over']} px too wide: {c['text']!r}"
            for c in self.clipped
        ]
        out += [
            f"        {s['src']} is shown {s['shown']} px wide of its {s['natural']} px"
            for s in self.small
        ]
        return out


def find_chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def pages(site: Path) -> list[Path]:
    skip = {"404.html"}
    return sorted(
        p
        for p in site.rglob("*.html")
        if p.name not in skip and "assets" not in p.parts and not p.name.endswith(".check.html")
    )


def check_page(
    chromium: str, site: Path, page: Path, width: int, height: int, shot_dir: Path | None
) -> PageReport:
    name = str(page.relative_to(site))
    html = page.read_text(encoding="utf-8")
    probe_copy = page.with_name(page.stem + ".check.html")
    probe_copy.write_text(html.replace("</body>", PROBE + "</body>", 1), encoding="utf-8")
    try:
        with tempfile.TemporaryDirectory(prefix="site-check-") as profile:
            flags = [
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
            ]
            dumped = subprocess.run(
                [chromium, *flags, "--virtual-time-budget=5000", "--dump-dom", probe_copy.as_uri()],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if shot_dir is not None:
                shot = shot_dir / (name.replace("/", "_").removesuffix(".html") + ".png")
                subprocess.run(
                    [chromium, *flags, f"--screenshot={shot}", page.as_uri()],
                    capture_output=True,
                    timeout=60,
                )
    except subprocess.TimeoutExpired:
        return PageReport(name, error="chromium did not finish within 60 s")
    finally:
        probe_copy.unlink(missing_ok=True)
    match = re.search(rf'<pre id="{REPORT_ID}" hidden="">(.*?)</pre>', dumped.stdout, re.S)
    if match is None:
        return PageReport(name, error="the page's probe did not report (did it load?)")
    found = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    return PageReport(name, found["page_overflow"], found["clipped"], found["small"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=Path("site"))
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--screenshots", type=Path, default=None)
    parser.add_argument("pages", nargs="*", help="pages to check (default: every page)")
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("no Chromium found (apt-get install chromium, or set $CHROMIUM)", file=sys.stderr)
        return 2
    site = args.site.resolve()
    if not (site / "index.html").exists():
        print(f"no built site in {site}: run `make docs` first", file=sys.stderr)
        return 2
    if args.screenshots is not None:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    todo = [site / p for p in args.pages] if args.pages else pages(site)
    reports = [
        check_page(chromium, site, page, args.width, args.height, args.screenshots) for page in todo
    ]
    for report in reports:
        print("\n".join(report.lines()))
    failed = [r for r in reports if not r.ok]
    print(f"{len(reports) - len(failed)} of {len(reports)} pages fit in {args.width} px")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
