"""The published throughput table of docs/throughput.md: every run of tests/data/throughput.toml priced by
`zeroplan estimate --gpu`, with its error, the distribution and the rankings
(tests/project/test_published_throughput.py checks them).

    python bench/throughput_table.py             # rewrites the table between the markers of docs/throughput.md
    python bench/throughput_table.py --no-write  # prints it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.throughput import WITHIN, distribution, price_all  # noqa: E402

DOC = REPO / "docs" / "throughput.md"
BEGIN, END = "<!-- table: bench/throughput_table.py -->", "<!-- end of table -->"


def _configuration(run: dict) -> str:
    model = run["model"].rsplit("/", 1)[-1].removesuffix(".toml")
    return f"`{model} --gpu {run['gpu']} {' '.join(run['args'])}`"


def table() -> str:
    priced = price_all()
    found = distribution(priced)
    lines = ["| run | source | quote | configuration (`zeroplan estimate` options) | published tokens/s/GPU | "
             "predicted | error |", "|---|---|---|---|---:|---:|---:|"]
    for p in priced:
        figure = (f"{p.published:,.0f}" if p.run["unit"] == "tokens/s/GPU"
                  else f"{p.published:,.1f} ({p.run['figure']} TFLOP/s, Eq. 3)")
        quote = p.run["quote"].replace("|", "\\|")
        lines.append(f"| {p.run['id']} | {p.run['source']} | {quote} | {_configuration(p.run)} | {figure} | "
                     f"{p.predicted:,.1f} | {p.error:+.0%} |")
    lines += ["", f"{found.runs} runs: {found.within:.0%} within {WITHIN:.0%}, median |error| {found.median_abs:.1%}, "
              f"median error {found.median:+.1%}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    text = table()
    if args.no_write:
        print(text)
        return
    doc = DOC.read_text(encoding="utf-8")
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:], encoding="utf-8")
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
