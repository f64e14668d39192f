"""Predicted vs published TTFT/TPOT for the planner's latency model (docs/planner.md, "Validation").

The published rows, their fit / held-out split and the predictions live in neuron_opt.planner.validation (the
`plan` command reports the held-out error next to its figures from the same rows).

  python scripts/validate_planner.py            # markdown table (pasted into docs/planner.md)
  python scripts/validate_planner.py --json     # machine-readable rows
  python scripts/validate_planner.py --fit      # re-derive the calibrated constants from the fit rows only
  python scripts/validate_planner.py --batched  # batched rows through the queue model (docs/planner.md, "Under load")
"""

from __future__ import annotations

import argparse
import json

from neuron_opt.planner.validation import FIT_ROWS, ROWS, fit, markdown, queue_markdown, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fit", action="store_true", help="re-derive the calibrated constants from the fit rows")
    ap.add_argument("--batched", action="store_true",
                    help="the batched rows' TTFT/TPOT percentiles from the queue model, fitted and held-out apart")
    args = ap.parse_args()
    if args.batched:
        print(queue_markdown(ROWS))
        return
    if args.fit:
        print(fit(FIT_ROWS))
        return
    print(json.dumps(table(ROWS), indent=1) if args.json else markdown(ROWS))


if __name__ == "__main__":
    main()
