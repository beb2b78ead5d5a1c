"""The README demo: train, crash for real, resume, and prove the result equals a run that never crashed."""
