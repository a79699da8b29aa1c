"""Contracts and bundled data shared by every layer of hetserve."""
