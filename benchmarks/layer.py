"""Layer benchmark script: ``python benchmarks/layer.py [--preset target] ...``.

A thin wrapper over ``structlm bench layer`` (same options); results go to
``benchmarks/results/`` by default.
"""

import sys

from structlm.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        preset = args[args.index("--preset") + 1] if "--preset" in args else "quick"
        args += ["--out", f"benchmarks/results/layer_cpu_{preset}"]
    sys.exit(main(["bench", "layer", *args]))
