"""NKI kernels; each `<name>.py` has a reference `<name>_ref.py` beside it and a host wrapper `run(...)`."""
