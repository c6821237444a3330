#!/usr/bin/env bash
# Fetch the LoRA paper's NLG data sets, the GPT-2 vocabulary and GPT-2 checkpoints from
# their public sources, then format and encode the data (examples/nlg/prepare.py).
# Not run in CI; needs curl and internet. Run from the project root:
#
#   bash examples/nlg/download.sh --data-dir data                 # everything
#   bash examples/nlg/download.sh --data-dir data --models gpt2-medium
#   bash examples/nlg/download.sh --data-dir data --no-models --no-prepare
#
# Layout written under --data-dir (the same as ../shared/data, so either can be passed
# as --data-dir to the training command):
#   e2e/{train,valid,test}.txt                  microsoft/LoRA examples/NLG/data/e2e (E2E NLG Challenge, CC BY-SA 4.0)
#   webnlg/{train,dev,test}.json                microsoft/LoRA examples/NLG/data/webnlg_challenge_2017 (CC BY-NC-SA 4.0)
#   dart/dart-v1.1.1-full-{train,dev,test}.json Yale-LILY/dart data/v1.1.1 (MIT)
#   gpt2-vocab/{encoder.json,vocab.bpe}         OpenAI GPT-2 (MIT)
#   checkpoints/<model>/{model.safetensors,config.json}   Hugging Face openai-community/<model>
#   <set>/{train,valid,test}_formatted.jsonl and <set>/{train,valid,test}.jsonl (after prepare)
# Files already present are kept; each download goes to a .part file renamed when complete.
set -euo pipefail

DATA_DIR=data
MODELS="gpt2 gpt2-medium gpt2-large"
PREPARE=1
PYTHON=${PYTHON:-python}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --data-dir) DATA_DIR=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --no-models) MODELS=""; shift ;;
    --no-prepare) PREPARE=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
done

LORA=https://raw.githubusercontent.com/microsoft/LoRA/main/examples/NLG/data
DART=https://raw.githubusercontent.com/Yale-LILY/dart/master/data/v1.1.1
OPENAI=https://openaipublic.blob.core.windows.net/gpt-2/models/124M
HF=https://huggingface.co/openai-community

fetch() {  # fetch URL DEST
  local url=$1 dest=$2
  if [ -s "$dest" ]; then echo "have $dest"; return; fi
  mkdir -p "$(dirname "$dest")"
  echo "get  $url"
  curl -fL --retry 3 --progress-bar -o "$dest.part" "$url"
  mv "$dest.part" "$dest"
}

for s in train valid test; do fetch "$LORA/e2e/$s.txt" "$DATA_DIR/e2e/$s.txt"; done
for s in train dev test; do fetch "$LORA/webnlg_challenge_2017/$s.json" "$DATA_DIR/webnlg/$s.json"; done
for s in train dev test; do
  fetch "$DART/dart-v1.1.1-full-$s.json" "$DATA_DIR/dart/dart-v1.1.1-full-$s.json"
done
fetch "$OPENAI/encoder.json" "$DATA_DIR/gpt2-vocab/encoder.json"
fetch "$OPENAI/vocab.bpe" "$DATA_DIR/gpt2-vocab/vocab.bpe"

for m in $MODELS; do
  case "$m" in gpt2|gpt2-medium|gpt2-large) ;; *) echo "unknown model $m" >&2; exit 2 ;; esac
  fetch "$HF/$m/resolve/main/config.json" "$DATA_DIR/checkpoints/$m/config.json"
  fetch "$HF/$m/resolve/main/model.safetensors" "$DATA_DIR/checkpoints/$m/model.safetensors"
done

if [ "$PREPARE" = 1 ]; then
  V="$DATA_DIR/gpt2-vocab"
  "$PYTHON" -m examples.nlg.prepare e2e --vocab "$V" --out-dir "$DATA_DIR/e2e" \
    train="$DATA_DIR/e2e/train.txt" valid="$DATA_DIR/e2e/valid.txt" test="$DATA_DIR/e2e/test.txt"
  "$PYTHON" -m examples.nlg.prepare webnlg --vocab "$V" --out-dir "$DATA_DIR/webnlg" \
    train="$DATA_DIR/webnlg/train.json" valid="$DATA_DIR/webnlg/dev.json" test="$DATA_DIR/webnlg/test.json"
  "$PYTHON" -m examples.nlg.prepare dart --vocab "$V" --out-dir "$DATA_DIR/dart" \
    train="$DATA_DIR/dart/dart-v1.1.1-full-train.json" valid="$DATA_DIR/dart/dart-v1.1.1-full-dev.json" \
    test="$DATA_DIR/dart/dart-v1.1.1-full-test.json"
fi
echo "done: $DATA_DIR"
