"""The composition root: settings, the factory that wires target, drafter and controller into an
engine, and the `bastion` command line (generate, serve, calibrate, bench, train-drafter).

Nothing below imports from here: server/, bench/ and training/ receive what they need as
arguments, engine/ knows neither the controller nor the server.
"""

from bastion.openmp import apply_defaults as _apply_openmp_defaults

_apply_openmp_defaults()  # before any submodule imports torch
