# ColossalAI ZeRO docs, example 3 verbatim: fast_init=OFFLOAD_PARAM_MAX_IN_CPU in the parameter
# offload config (fast_init is an optimizer-offload option; max_in_cpu was meant).
OFFLOAD_PARAM_MAX_IN_CPU = 1000000000
zero = dict(
    type='ZeroRedundancyOptimizer_Level_3',
    offload_optimizer_config=dict(
        device='cpu',
        pin_memory=True,
        fast_init=True
    ),
    offload_param_config=dict(
        device='cpu',
        pin_memory=True,
        fast_init=OFFLOAD_PARAM_MAX_IN_CPU
    ),
)
