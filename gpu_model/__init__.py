"""Accelerator side of hetserve: the Llama model split into decode-step halves, weights, sampler."""
