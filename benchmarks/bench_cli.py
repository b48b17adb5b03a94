"""`mixprec demo --steps 1`: how long a short demo takes against the floor (importing torch).

Each case runs in a fresh process, the cases interleaved, ``--repeat`` times; medians and
ratios to the floor are printed side by side. Cases:

* floor: ``import torch`` and the demo's modules, nothing else;
* demo: ``mixprec demo --steps 1 --no-plot --no-progress`` as it runs now;
* demo + dynamo: the same after ``import torch._dynamo``, which is what every torch optimizer's
  first call pays (the demo used ``torch.optim.Adam`` directly before it stepped around that);
* demo + figure: the default, with the figure (matplotlib).

    python benchmarks/bench_cli.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

DEMO = "from mixprec.cli import main; raise SystemExit(main({argv!r}))"
ARGV = ["demo", "--steps", "1", "--no-progress"]


def cases(out: str) -> dict[str, str]:
    return {
        "floor (import torch, mixprec.cli.demo)": "import torch, mixprec.cli.demo",
        "demo --steps 1 --no-plot": DEMO.format(argv=[*ARGV, "--no-plot"]),
        "demo --steps 1 --no-plot, dynamo imported": "import torch._dynamo; "
        + DEMO.format(argv=[*ARGV, "--no-plot"]),
        "demo --steps 1 (with the figure)": DEMO.format(argv=[*ARGV, "--out", out]),
    }


def _time(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (default: 5)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (1)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as out:
        todo = cases(out)
        times: dict[str, list[float]] = {name: [] for name in todo}
        for _ in range(args.repeat):
            for name, code in todo.items():
                times[name].append(_time(code))
    medians = {name: statistics.median(values) for name, values in times.items()}
    floor = next(iter(medians.values()))
    print(f"load average {os.getloadavg()[0]:.1f}, {args.repeat} runs per case, medians")
    print("| case | seconds | x floor |\n|---|---:|---:|")
    for name, value in medians.items():
        print(f"| {name} | {value:.2f} | {value / floor:.2f} |")


if __name__ == "__main__":
    main()
