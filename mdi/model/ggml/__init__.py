"""The ggml compute backend: a node's layers, embedding and head as ggml graphs over GGUF
tensors used as stored (llama.cpp's kernels, driven from Python through the ggml binding)."""
