"""fw_gguf: GGUF weights for fw.

Modules (import what you need; this package imports nothing heavy on its own):

* `fw_gguf.dequant`: torch dequantization of GGUF blocks, bit-exact with gguf-py.
* `fw_gguf.reader`: open single or split GGUF files (metadata + zero-copy tensor bytes).
* `fw_gguf.config`: Hugging Face config dict, tensor names and q/k un-permutation.
* `fw_gguf.tokenizer`: a `tokenizers.Tokenizer` from GGUF tokenizer metadata.
* `fw_gguf.lazy`: GGUF tensors as lazy checkpoint slices (MoE experts decoded per rank, in the model dtype).
"""
