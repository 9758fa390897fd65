"""What autograd keeps for backward: one micro-batch's activations through the blocks, per family, and the
mixture-of-experts and latent-attention terms."""
