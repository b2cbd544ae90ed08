"""Drafters the engine runs: DFlash, the suffix index, their hybrid, and the proposal types they emit."""
