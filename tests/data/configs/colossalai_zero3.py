# ColossalAI ZeRO docs, example 1: partition optimizer states, gradients and parameters.
optimizer = dict(
    type='Adam',
    lr=0.001,
    weight_decay=0
)

zero = dict(
    type='ZeroRedundancyOptimizer_Level_3',
    dynamic_loss_scale=True,
    clip_grad=1.0
)
