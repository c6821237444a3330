#!/usr/bin/env bash
# Fetch GLUE SST-2, BERT's uncased WordPiece vocabulary and (optionally) the real
# distilbert-base-uncased checkpoint from their public sources, then encode SST-2
# (examples/cls/prepare.py). Not run in CI; needs curl, unzip and internet. From the project root:
#
#   bash examples/cls/download.sh --data-dir data              # data, vocabulary, checkpoint
#   bash examples/cls/download.sh --data-dir data --no-model   # without the checkpoint
#
# Layout written under --data-dir (the same as ../shared/data):
#   sst2/{train,dev,test}.tsv                     GLUE SST-2 (dl.fbaipublicfiles.com/glue/data/SST-2.zip)
#   distilbert-vocab/{vocab.txt,config.json}      Hugging Face distilbert/distilbert-base-uncased (Apache-2.0)
#   checkpoints/distilbert-base-uncased/{model.safetensors,config.json}
#   sst2/prepared/{train,dev,test}.jsonl          after prepare
# Files already present are kept; each download goes to a .part file renamed when complete.
set -euo pipefail

DATA_DIR=data
MODEL=1
PYTHON=${PYTHON:-python}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --data-dir) DATA_DIR=$2; shift 2 ;;
    --no-model) MODEL=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
done

GLUE=https://dl.fbaipublicfiles.com/glue/data/SST-2.zip
HF=https://huggingface.co/distilbert/distilbert-base-uncased/resolve/main

fetch() {  # fetch URL DEST
  local url=$1 dest=$2
  if [ -s "$dest" ]; then echo "have $dest"; return; fi
  mkdir -p "$(dirname "$dest")"
  echo "get  $url"
  curl -fL --retry 3 --progress-bar -o "$dest.part" "$url"
  mv "$dest.part" "$dest"
}

if [ ! -s "$DATA_DIR/sst2/dev.tsv" ]; then
  fetch "$GLUE" "$DATA_DIR/sst2/SST-2.zip"
  unzip -o -q "$DATA_DIR/sst2/SST-2.zip" -d "$DATA_DIR/sst2/unzipped"
  for s in train dev test; do mv "$DATA_DIR/sst2/unzipped/SST-2/$s.tsv" "$DATA_DIR/sst2/$s.tsv"; done
  rm -rf "$DATA_DIR/sst2/unzipped" "$DATA_DIR/sst2/SST-2.zip"
fi
fetch "$HF/vocab.txt" "$DATA_DIR/distilbert-vocab/vocab.txt"
fetch "$HF/config.json" "$DATA_DIR/distilbert-vocab/config.json"
if [ "$MODEL" = 1 ]; then
  fetch "$HF/model.safetensors" "$DATA_DIR/checkpoints/distilbert-base-uncased/model.safetensors"
  fetch "$HF/config.json" "$DATA_DIR/checkpoints/distilbert-base-uncased/config.json"
fi
"$PYTHON" -m examples.cls.prepare --data-dir "$DATA_DIR/sst2" --vocab "$DATA_DIR/distilbert-vocab/vocab.txt" \
  --out-dir "$DATA_DIR/sst2/prepared"
