"""Vision-language models: a request's images (`inputs.py`: the prompt rendered through the model's processor, each
image's placeholder positions, encoder inputs and content hash; the prefix-cache keys over image content), the
encoder cache (`encoder_cache.py`: each image encoded once per request), and vision-language checkpoints
(`vision.py`: the architectures that take images, the vision encoder and processor beside the text decoder), and
the encoder compiled per image-size bucket (`compiled.py`).
docs/multimodal.md states the contracts."""
