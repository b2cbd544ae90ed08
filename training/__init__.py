"""Drafter training: prompts, target-generated data, and the DFlash training loop.

It sits above engine/ (it decodes with the target to make data) and bench/ (it keeps its
prompts clear of every benchmark prompt); `bastion train-drafter` (bastion/train_drafter.py)
drives it. Nothing in engine/, drafting/ or controller/ imports it.
"""
