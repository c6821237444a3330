"""Files of the spec: tensor files (safetensors, torch pickles read without torch), model checkpoints, adapters in our format and peft's; strict loaders, atomic writers."""
