"""What a prepared model directory (mdi-prepare) holds, by file name: one home for the names,
without torch (a worker resolving weights.path for the ggml backend reads them too)."""
MDI_CONFIG = "mdi_config.json"  # the model's config (mdi.model.config) and how the weights are stored
MODEL_FILE = "model.safetensors"  # the torch backend's weights, in mdi's canonical names
GGUF_FILE = "model.gguf"  # the ggml backend's: a GGUF, its tensors as stored
