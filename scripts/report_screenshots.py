"""Screenshots of a study's report for the README: docs/report-*.png.

    .venv/bin/autotune run && .venv/bin/autotune report
    .venv/bin/python scripts/report_screenshots.py results/tiny-qwen2.5-cpu-demo/report.html

Opens the page in the system's headless Chromium (Debian's `chromium`; playwright drives it,
no browser of its own) with the network refused, and writes three clipped PNGs: the headline
with the throughput/memory plot, the memory per phase with the sweep over time, and the memory
model against measurement.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = {  # file: (first section's figure key or None for the page top, last figure key)
    "report-headline.png": (None, "frontier"),
    "report-memory.png": ("phases", "timeline"),
    "report-model.png": ("model", "model"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--out-dir", type=Path, default=Path("docs"))
    parser.add_argument("--width", type=int, default=1100)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None or not args.report.is_file():
        print("needs Debian's chromium (apt-get install chromium) and a report.html",
              file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    args.out_dir.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=ARGS)
        page = browser.new_page(viewport={"width": args.width, "height": 900})
        page.route("**/*", lambda route: route.continue_()
                   if route.request.url.startswith("file:") else route.abort())
        page.goto(args.report.resolve().as_uri(), wait_until="load")
        page.wait_for_timeout(800)
        boxes = page.evaluate("""() => Object.fromEntries(
            [...document.querySelectorAll('[data-figure]')].map(div => {
                const heading = div.previousElementSibling.previousElementSibling;
                const top = heading.getBoundingClientRect().top + window.scrollY;
                const bottom = div.getBoundingClientRect().bottom + window.scrollY;
                return [div.dataset.figure, [top, bottom]];
            }))""")
        for name, (first, last) in SHOTS.items():
            top = 0 if first is None else boxes[first][0] - 10
            clip = {"x": 0, "y": top, "width": args.width, "height": boxes[last][1] - top + 10}
            page.screenshot(path=str(args.out_dir / name), clip=clip, full_page=True)
            print(args.out_dir / name, f"{(args.out_dir / name).stat().st_size // 1024} KiB")
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
