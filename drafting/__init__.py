"""Drafters: components that propose candidate continuations (marginals or candidate trees)."""
