"""A report page in real headless chromium (Debian's package): the DOM after its scripts ran,
the markers each plot drew, every console message, and a screenshot. Network requests fail
(a proxy that does not exist): a page that needs the network shows it as console errors."""

import html.parser
import shutil
import subprocess
import tempfile
from pathlib import Path

BROWSER = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
         "--virtual-time-budget=15000", "--enable-logging=stderr", "--v=0"]


def chromium(page: Path, *args, timeout=180) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={profile}", *args,
                               page.resolve().as_uri()],
                              capture_output=True, text=True, timeout=timeout)


def console(stderr: str) -> list[str]:
    """Every console message (log, warning, error, uncaught exception, failed load)."""
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln]


class _Plots(html.parser.HTMLParser):
    """{plot div id: (data-points, markers drawn inside it)} of the rendered DOM."""

    def __init__(self):
        super().__init__()
        self.plots: dict[str, list] = {}
        self.stack: list[str | None] = []  # the plot id each open div belongs to

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if tag == "div":
            inside = self.stack[-1] if self.stack else None
            if "plot" in cls and "data-points" in a:
                inside = a["id"]
                self.plots[inside] = [int(a["data-points"]), 0]
            self.stack.append(inside)
        elif tag == "path" and "point" in cls and self.stack and self.stack[-1]:
            self.plots[self.stack[-1]][1] += 1

    def handle_endtag(self, tag):
        if tag == "div" and self.stack:
            self.stack.pop()


def rendered(page: Path) -> tuple[dict, list[str]]:
    """({plot id: (points in its data, markers drawn)}, console messages)."""
    r = chromium(page, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    p = _Plots()
    p.feed(r.stdout)
    return {k: tuple(v) for k, v in p.plots.items()}, console(r.stderr)


def screenshot(page: Path, png: Path, width=1150, height=2600) -> None:
    r = chromium(page, f"--window-size={width},{height}", f"--screenshot={png}")
    assert r.returncode == 0 and png.stat().st_size > 10000, r.stderr[-2000:]
