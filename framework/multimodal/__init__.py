"""Images in prompts: the seam between a vision model, the API process and the engine.

A vision model declares a :class:`~framework.multimodal.inputs.VisionSpec` (its torch-free image
processor, the processor's settings and the placeholder token its chat template writes per
image). The API process (or :class:`framework.LLM`) decodes each image
(:mod:`~framework.multimodal.images`), preprocesses it with that processor, and expands each
placeholder token into the image's span: one image token per embedding, laid out with the model's
layout tokens where it has them (:mod:`~framework.multimodal.prompt`); the pixels cross to the engine as
:class:`~framework.multimodal.inputs.ImageInput`. The engine runs the vision encoder inside the
prefill step that first reaches an image's tokens and keeps its output for the life of the
request (:mod:`framework.engine.multimodal_step`); each image's hash enters the prefix-cache key
of every block its tokens touch.
"""
