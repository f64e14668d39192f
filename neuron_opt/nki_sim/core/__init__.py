"""Front-end independent core of the NKI simulator.

The core knows about memories (HBM, SBUF, PSUM), tiles and views, hardware rules, engine numerics and the
cost model. It knows nothing about how an API spells a call: `language.py` / `isa.py` (the `neuronxcc.nki`
generation) translate calls into core operations, and a dst-first front end for the current `nki` API can do
the same without touching this package.
"""
