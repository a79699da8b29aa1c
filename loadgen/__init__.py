"""Trace replay and synthetic load against OpenAI-compatible servers (planned; see DESIGN.md)."""
