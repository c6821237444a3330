#!/usr/bin/env bash
# wikitext-2-raw (Merity et al. 2016), the text of the LoRA/QLoRA fine-tuning studies, for
# examples.lm.prepare. Not committed: fetched from its public source into DEST (default data/).
#   bash examples/lm/download.sh [DEST]
#   python -m examples.lm.prepare --tokenizer MODEL_DIR \
#       --train DEST/wikitext-2-raw/wiki.train.raw --valid DEST/wikitext-2-raw/wiki.valid.raw \
#       --block-size 512 --out-dir out/wikitext2
# (Hugging Face's copy, datasets' "wikitext" / "wikitext-2-raw-v1", has the same text in parquet.)
set -euo pipefail
dest=${1:-data}
mkdir -p "$dest"
url=https://wikitext.smerity.com/wikitext-2-raw-v1.zip
echo "fetching $url"
curl -fL --retry 3 -o "$dest/wikitext-2-raw-v1.zip" "$url"
(cd "$dest" && unzip -o -q wikitext-2-raw-v1.zip && rm wikitext-2-raw-v1.zip)
ls -l "$dest/wikitext-2-raw"
