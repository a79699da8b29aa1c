"""Simulated Oaken accelerators and GPU baselines: a per-step cost model (cost.py) on device and model
shapes (hardware.py, models.py, data/), a discrete-event simulator of a pool of replicas (sim.py) with
sweeps, validation against the paper and trace replay (`hetserve sim`), and `--backend sim`, which
gives the real server's tokens simulated timing (backend.py)."""
