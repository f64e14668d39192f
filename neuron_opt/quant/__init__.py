"""Quantization: `weights.py` (the weight-only formats int8, int4 and fp8, their quantizers, and the module a
quantized linear holds), `kv.py` (the fp8 KV cache: per-layer scales calibrated at compile time and folded into the
weights), `gguf.py` (GGUF's Q4_0/Q4_1 blocks as the int4 format, and the quantization a GGUF file ships with)."""
