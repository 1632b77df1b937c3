"""Suite-wide settings, applied before any test module imports torch."""

import os

# Passive OpenMP waits: spinning worker threads collapse the engine's speed when another
# process shares the cores (kvoffload's CLI sets the same before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
