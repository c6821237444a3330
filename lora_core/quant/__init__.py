"""Weight quantization in the spec (numpy, no framework): NF4 with double quantization as
bitsandbytes stores it (QLoRA, Dettmers et al. 2023), the names a 4-bit base quantizes, and
bitsandbytes' checkpoint layout (``lora_core.formats.bnb4bit``)."""
