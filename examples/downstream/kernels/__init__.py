"""This project's kernels. Its own package is called ``kernels``, as many are: the suite
installs nothing under that name, so the two never collide."""
