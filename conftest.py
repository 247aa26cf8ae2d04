"""Top-level conftest of the repository.

The suite's pytest plugin (``conformance.plugin``) is not named here: it loads
through the package's ``pytest11`` entry point wherever the suite is installed
(``pip install -e .`` in a checkout, what tox does), exactly as in a user's project.
"""
