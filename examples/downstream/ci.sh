#!/usr/bin/env bash
# This project's CI: its own tests, its own family, then the conformance suite on its kernels
# (separate pytest runs: the suite needs 8 simulated CPU devices, this project's tests the default one).
set -euo pipefail
cd "$(dirname "$0")"
out=${OUT:-conformance-results}
mkdir -p "$out"
pytest -q
# a family of our own, and the suite's mesh fixture and checks reused in our tests
pytest conformance_family -m cpu -q -p no:cacheprovider
pytest --pyargs conformance -m cpu --kernels=kernels.collectives --impl='downstream_*' \
  --xfails-file=known_failures.txt \
  --conformance-json="$out/conformance.json" --conformance-html="$out/conformance.html" \
  -p no:cacheprovider -q
