"""Discrete-event simulator of a pool of Oaken accelerators (planned; see DESIGN.md)."""
