"""fw_fp8: FP8 (E4M3) weights for fw.

Modules (this package imports nothing heavy on its own):

* `fw_fp8.config`: the formats' QuantConfigs (fp8, compressed-tensors-fp8, fbgemm_fp8, modelopt) and :class:`Fp8Scheme`.
* `fw_fp8.quantize`: :func:`quantize_weight_fp8`, the block quantizer (``--quantization fp8``, ISQ).
* `fw_fp8.params`: block scales as parameters of fused and tensor-parallel layers.
* `fw_fp8.method` / `fw_fp8.moe`: the linear and FusedMoE quant methods.
* `fw_fp8.kernels`: the layout, the W8A16 and W8A8 Triton kernels, ``torch._scaled_mm``, the dispatch.
"""
