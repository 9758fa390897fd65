"""What a rank holds: the model's parameter layout tensor by tensor (dense and mixture-of-experts blocks) and
the facts the engines read of it, adapters applied (adapters/lora.py)."""
