"""sdp4bit for Megatron: megatron-core's distributed optimizer with compressed collectives.

- :mod:`megatron_patch.megatron_core`: ``enable(config)`` patches megatron-core's bucket
  groups so that their reduce-scatter and all-gather go through :mod:`sdp4bit`;
- :mod:`megatron_patch.arguments`: the ``--sdp4bit*`` flags of Megatron-LM scripts;
- ``python -m megatron_patch SCRIPT``: runs an unmodified Megatron-LM script with the flags
  (:mod:`megatron_patch.launcher`).

The library itself (config, process groups, collectives, DeepSpeed, FSDP2, the cost model) is
the ``sdp4bit`` package.
"""
