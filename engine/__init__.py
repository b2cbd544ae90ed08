"""Decoding engine: target loading, tree building, verification and the generation loop."""
