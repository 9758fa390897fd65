# ColossalAI ZeRO docs, examples 2 and 3 merged with example 1 (the docs write "..." for the rest):
# optimizer states and parameters offloaded to CPU.
OFFLOAD_PARAM_MAX_IN_CPU = 1000000000
zero = dict(
    type='ZeroRedundancyOptimizer_Level_3',
    dynamic_loss_scale=True,
    clip_grad=1.0,
    offload_optimizer_config=dict(
        device='cpu',
        pin_memory=True,
        fast_init=True
    ),
    offload_param_config=dict(
        device='cpu',
        pin_memory=True,
        max_in_cpu=OFFLOAD_PARAM_MAX_IN_CPU
    ),
)
