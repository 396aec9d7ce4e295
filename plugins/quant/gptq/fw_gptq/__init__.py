"""fw_gptq: integer-weight checkpoints (GPTQ, AWQ, compressed-tensors W4A16/W8A16, Marlin) for fw.

Modules (this package imports nothing heavy on its own):

* `fw_gptq.config`: the three formats' QuantConfigs and their shared :class:`WNA16Scheme`.
* `fw_gptq.packing`: each format's int packing, both ways, to one canonical :class:`IntWeight`.
* `fw_gptq.params`: each format's checkpoint tensors as layer parameters.
* `fw_gptq.method` / `fw_gptq.moe`: the linear and FusedMoE quant methods.
* `fw_gptq.kernels`: the kernel layout and the W4A16/W8A16 Triton core.
* `fw_gptq.quantize`: ``fw quantize`` (RTN, GPTQ, AWQ) writing standard checkpoints.
"""
