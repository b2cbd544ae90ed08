"""Decoding engine: target loading, the best-first tree builder, verification, acceptance, the decode loop and its step accounting."""
