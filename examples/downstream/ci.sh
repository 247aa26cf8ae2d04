#!/usr/bin/env bash
# This project's CI: its own tests, then the conformance suite on its kernels (two pytest runs:
# the suite needs 8 simulated CPU devices, this project's tests the default one).
set -euo pipefail
cd "$(dirname "$0")"
out=${OUT:-conformance-results}
mkdir -p "$out"
pytest -q
pytest --pyargs conformance -m cpu --kernels=kernels.collectives --impl='downstream_*' \
  --xfails-file=known_failures.txt \
  --conformance-json="$out/conformance.json" --conformance-html="$out/conformance.html" \
  -p no:cacheprovider -q
