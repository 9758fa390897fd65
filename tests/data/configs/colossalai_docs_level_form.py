# Older ColossalAI docs: zero = dict(level=3, ...) (colossalai/zero/__init__.py convert_to_zero).
zero = dict(
    level=3,
    dynamic_loss_scale=True,
    clip_grad=1.0
)
