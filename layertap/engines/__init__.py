"""Engines turn tokenized samples into captured hidden states."""
