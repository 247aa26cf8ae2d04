"""The suite's own tests: kernels broken in one known way each, which the suite must reject."""
