"""Causal-LM examples on the Llama family (``lora_core.models.llama``): ``bench`` times LoRA
training and greedy decoding of ours-torch, ours-jittor and transformers + peft."""
