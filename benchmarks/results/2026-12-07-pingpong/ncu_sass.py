"""Top SASS lines of an ncu report by warp-stall samples, and the stall reasons of the whole kernel:
`python3 ncu_sass.py REPORT.ncu-rep [N]` (needs ncu on PATH)."""
import csv
import io
import subprocess
import sys

rep, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40


def page(*args):
    out = subprocess.run(["ncu", "-i", rep, "--csv", *args], capture_output=True, text=True).stdout
    return list(csv.reader(io.StringIO(out[out.find('"'):])))


raw = page("--page", "raw")
head, vals = raw[0], raw[-1]
stalls = sorted(((float(v.replace(",", "")), h) for h, v in zip(head, vals)
                 if h.startswith("smsp__pcsamp_warps_issue_stalled_") and not h.endswith("_not_issued")
                 and v.replace(",", "").replace(".", "").isdigit()), reverse=True)
total = sum(v for v, _ in stalls) or 1
print("# stall samples by reason (all SASS)")
for v, h in stalls[:14]:
    print(f"{100 * v / total:6.1f} %  {h[len('smsp__pcsamp_warps_issue_stalled_'):]}")
src = page("--page", "source", "--print-source", "sass")
hdr = next(r for r in src if any("Sampling" in c for c in r))
rows = src[src.index(hdr) + 1:]
col = next(i for i, c in enumerate(hdr) if "Warp Stall Sampling (All" in c)
srccol = next(i for i, c in enumerate(hdr) if c.strip().lower() == "source")
num = lambda r: float(r[col].replace(",", "") or 0) if len(r) > col else 0.0  # noqa: E731
alls = sum(num(r) for r in rows) or 1
print(f"# top {top} SASS lines by stall samples (of {len(rows)} lines; column {hdr[col]!r})")
for i, r in sorted(enumerate(rows), key=lambda t: -num(t[1]))[:top]:
    print(f"{i:5d} {100 * num(r) / alls:5.1f} %  {r[srccol][:110]}")
