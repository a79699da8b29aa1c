"""CPU side of hetserve: the paged KV store and attention kernels."""
