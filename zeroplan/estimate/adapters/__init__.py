"""LoRA, DoRA and QLoRA: what PEFT adds and trains, how bitsandbytes stores the frozen base, and what the
adapted program holds beside the engine's profile (docs/engines/lora.md)."""
