#!/usr/bin/env python
"""Decode tokens/s: HF transformers vs neuron_opt eager and compiled (fp32, bf16), batch 1 and 8. See --help."""

import sys

from neuron_opt.bench.decode import main

if __name__ == "__main__":
    sys.exit(main())
