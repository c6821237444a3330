"""LoRA for any model, without tensors: which modules get LoRA (targeting), the injection plan, parameter naming, seeded dropout masks and the numpy reference of the math."""
