"""Prompts: where they come from and how they become tokens."""
