"""Top SASS lines of an ncu report by warp-stall samples, and the kernel's stall reasons, from two
CSV exports of the report (so that the parse can be redone anywhere):

    ncu -i R.ncu-rep --csv --page raw > raw.csv
    ncu -i R.ncu-rep --csv --page source --print-source sass > sass.csv
    python3 ncu_sass.py raw.csv sass.csv [N]
"""
import csv
import sys


def rows(path):
    text = open(path, errors="replace").read()
    return list(csv.reader(text[text.find('"'):].splitlines()))


def num(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


raw_path, sass_path = sys.argv[1], sys.argv[2]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
raw = rows(raw_path)
head, vals = raw[0], raw[-1]
prefix = "smsp__pcsamp_warps_issue_stalled_"
stalls = sorted(((num(v), h[len(prefix):]) for h, v in zip(head, vals)
                 if h.startswith(prefix) and not h.endswith("_not_issued")), reverse=True)
total = sum(v for v, _ in stalls) or 1
print("# stall samples by reason (whole kernel)")
for v, h in stalls[:14]:
    print(f"{100 * v / total:6.1f} %  {h}")
src = rows(sass_path)
hdr_i = next(i for i, r in enumerate(src) if any("Sampling" in c for c in r))
hdr, body = src[hdr_i], src[hdr_i + 1:]
col = next(i for i, c in enumerate(hdr) if "Warp Stall Sampling (All" in c)
srccol = next((i for i, c in enumerate(hdr) if c.strip().lower() == "source"), 1)
val = lambda r, i: num(r[i]) if len(r) > i else 0.0  # noqa: E731
alls = sum(val(r, col) for r in body) or 1
print(f"# top {top} SASS lines by stall samples ({len(body)} lines; column {hdr[col]!r}; header: {hdr[:12]})")
for i, r in sorted(enumerate(body), key=lambda t: -val(t[1], col))[:top]:
    print(f"{i:5d} {100 * val(r, col) / alls:5.1f} %  {r[srccol][:100]}")
