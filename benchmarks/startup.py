"""Start-up cost of the command line and of a rank's parameter init: one JSON object.

Each row runs a fresh interpreter `--repeat` times (default 10) and reports the median and
best wall time, beside the bare interpreter's (`python -c pass`, the floor), and which modules
of pcompile, pydantic and JAX the command loaded:

* `version`: `pcompile --version` (issue 37 move 1's target: under 0.3 s);
* `params`: `import pcompile.backends.params, pcompile.backends.jax.param_init` (a rank's
  parameter init: no module of pcompile.compiler, no pydantic).

    python benchmarks/startup.py [--repeat N]

Nothing is asserted: the numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("import sys; print(' '.join(sorted(m for m in sys.modules if m in ('pydantic', 'jax', "
         "'click') or m.startswith(('pcompile.compiler', 'pcompile.program')))))")
ROWS = {
    "python": [sys.executable, "-c", "pass"],
    "version": [sys.executable, "-c",
                "import sys\nfrom pcompile.cli import main\nsys.argv = ['pcompile', '--version']"
                "\ntry:\n    main()\nexcept SystemExit:\n    pass"],
    "params": [sys.executable, "-c",
               "import pcompile.backends.params, pcompile.backends.jax.param_init"],
}


def timed(cmd: list[str], repeat: int) -> dict[str, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        times.append(time.perf_counter() - start)
    return {"median_s": round(statistics.median(times), 3), "best_s": round(min(times), 3)}


def loaded(cmd: list[str]) -> list[str]:
    out = subprocess.run(cmd[:2] + [cmd[2] + "\n" + PROBE], check=True, capture_output=True,
                         text=True, cwd=ROOT).stdout.split("\n")
    return out[-2].split() if len(out) > 1 else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for name, cmd in ROWS.items():
        row: dict[str, object] = {"row": name, **timed(cmd, args.repeat)}
        if name != "python":
            row["loaded"] = loaded(cmd)
        rows.append(row)
    print(json.dumps({"benchmark": "startup", "cpus": os.cpu_count(),
                      "load": os.getloadavg()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
