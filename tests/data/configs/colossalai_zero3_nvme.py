# The full example of the ColossalAI ZeRO docs (seeds/003): ZeRO level 3, optimizer states and
# parameters offloaded to NVMe.
OFFLOAD_PARAM_MAX_IN_CPU = 1000000000

optimizer = dict(type='Adam', lr=0.001, weight_decay=0)

zero = dict(
    type='ZeroRedundancyOptimizer_Level_3',
    dynamic_loss_scale=True,
    clip_grad=1.0,
    offload_optimizer_config=dict(
        device='nvme',
        pin_memory=True,
        fast_init=True,
        nvme_path='/nvme_data'
    ),
    offload_param_config=dict(
        device='nvme',
        pin_memory=True,
        max_in_cpu=OFFLOAD_PARAM_MAX_IN_CPU,
        nvme_path='/nvme_data'
    ),
)
