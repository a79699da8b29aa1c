"""Accelerator side of hetserve: the Llama model split into decode-step halves, weights, sampler."""
# cpu_attn sets Numba's cache directory (cpu_attn/__init__.py). Numba picks a kernel's cache directory when the
# kernel is defined, so importing cpu_attn first puts ours in the same place in every process: a Ray model actor
# (which imports cpu_attn before gpu_model.quant) recompiled the blocks kernels that the driver had cached elsewhere.
import cpu_attn  # noqa: F401
