"""Reusable tensor codecs (no cache logic)."""
