"""The IREE backend routes: jax.export StableHLO compiled by IREE for Vulkan (vulkan-spirv) and the CPU
(llvm-cpu), run with weights and the paged KV resident on the IREE device."""
