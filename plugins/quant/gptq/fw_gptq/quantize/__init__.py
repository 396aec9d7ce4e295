"""``fw quantize``: RTN, GPTQ and AWQ from a 16-bit Hugging Face model to a standard checkpoint.

* `rtn`: round-to-nearest integers of one weight (the base of the other two);
* `gptq`: GPTQ's error-compensating column-by-column rounding from a calibration Hessian;
* `awq`: AWQ's activation-aware per-input-channel scale search, folded into the previous op;
* `calibrate`: one pass of calibration text through transformers' model, collecting statistics;
* `writer`: the quantized checkpoint in the GPTQ, AWQ or compressed-tensors layout;
* `cli`: the command.
"""
