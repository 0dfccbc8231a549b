"""
The curves of train.py runs from their log.jsonl: loss, acceptance (train and held-out), learning
rate and tokens/s by step, one PNG (matplotlib: pip install matplotlib).

  python plot.py out                 # writes out/curves.png
  python plot.py out other --png runs.png   # runs side by side
"""
import json
import os
import sys

from data import ArgParser, DataError, package

def curves(out):
    # {kind: {field: [(step, value)]}} of train and eval records; of one step the last record wins
    # (a resumed run redid the steps after its checkpoint)
    last = {}
    with open(os.path.join(out, "log.jsonl")) as f:
        for r in map(json.loads, f):
            if r["kind"] in ("train", "eval"):
                last[r["kind"], r["step"]] = r
    return {kind: {k: [(s, r[k]) for (kd, s), r in sorted(last.items()) if kd == kind and k in r]
                   for k in ("loss", "accept", "lr", "tok_s")} for kind in ("train", "eval")}

def main(argv=None):
    ap = ArgParser(description=__doc__)
    ap.add_argument("outs", nargs="+", metavar="OUT", help="train.py --out dirs")
    ap.add_argument("--png", help="the image (default: OUT/curves.png of the first OUT)")
    args = ap.parse_args(argv)
    try:
        plt = package("matplotlib.pyplot", "plot.py")
    except DataError as e:
        sys.exit(f"error: {e.args[0].replace('matplotlib.pyplot', 'matplotlib')}")
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for out in args.outs:
        if not os.path.exists(os.path.join(out, "log.jsonl")):
            sys.exit(f"error: {out}/log.jsonl not found: pass train.py's --out dirs")
        name = os.path.basename(os.path.normpath(out))
        for kind, c in curves(out).items():
            for ax, k in zip(axes, ("loss", "accept", "lr", "tok_s")):
                if c[k]:     # eval points marked
                    mark = "." if kind == "eval" else None
                    ax.plot(*zip(*c[k]), label=f"{name} {kind}", marker=mark)
    for ax, title in zip(axes, ("loss", "acceptance proxy (blocks)", "learning rate", "tokens/s")):
        ax.set_title(title), ax.set_xlabel("step"), ax.legend(fontsize=7)
    png = args.png or os.path.join(args.outs[0], "curves.png")
    fig.savefig(png, dpi=90, bbox_inches="tight")
    print(f"wrote {png}")
    return png

if __name__ == "__main__":
    main()
